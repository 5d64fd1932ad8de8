#!/bin/bash
# The three passes of dspark-trainer on a Slurm cluster: regenerate the data, extract the
# verifier's hidden states, train the drafter. Every node runs one task per step; each pass
# spreads over all nodes and all their GPUs.
#
#   DSPARK_RUNS=/shared/runs sbatch --nodes=4 examples/slurm-scale-out.sh     # the embedded default
#   DSPARK_RUNS=/shared/runs TP=2 RECIPE="+experiment=qwen3-0.6b" DATA="data=hf data.path=ORG/NAME" \
#       sbatch --nodes=4 examples/slurm-scale-out.sh
#
# Needs: the repo and its venv (`make setup`) at the same path on every node, and DSPARK_RUNS
# on a filesystem every node sees (the dataset, the shard store and the checkpoints live
# there). The store may also be object storage: add paths.store_dir=s3://bucket/store to ARGS
# of the extract and train passes.
#SBATCH --job-name=dspark
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
set -euo pipefail

: "${DSPARK_RUNS:?set DSPARK_RUNS to a directory on a filesystem shared by every node}"
export DSPARK_RUNS
GPUS=${GPUS:-${SLURM_GPUS_PER_NODE:-8}}   # devices per node
TP=${TP:-1}                               # devices per vLLM server (a verifier too big for one GPU: 2, 4, 8)
RECIPE=${RECIPE:-}                        # Hydra overrides of every pass (target, experiment)
DATA=${DATA:-}                            # ... and of the data pass only (data=hf data.path=...)
NODES=$SLURM_NNODES
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
export GPUS TP RECIPE DATA NODES MASTER_ADDR MASTER_PORT
cd "${SLURM_SUBMIT_DIR:-.}"

# $SLURM_NODEID is expanded by each task, on its own node.
on_every_node() { srun --nodes="$NODES" --ntasks-per-node=1 bash -c "$1"; }

# 1. Regeneration: node r regenerates the conversations at positions ≡ r (mod NODES) of the
#    sorted sample ids with GPUS/TP servers, into its own journal; the last node to finish
#    writes the dataset. A rerun of the job continues where a killed one stopped.
on_every_node 'make data GPUS=$GPUS TP=$TP NODES=$NODES NODE_RANK=$SLURM_NODEID ARGS="$RECIPE $DATA"'
# Every share is journaled now: this finds nothing to regenerate and (re)writes the dataset.
make data ARGS="$RECIPE $DATA"

# 2. Extraction: node r extracts its share of every split into the one shared store (shard
#    claims keep writers apart); a separate run_dir per node keeps server logs and summaries apart.
on_every_node 'make extract GPUS=$GPUS TP=$TP NODES=$NODES NODE_RANK=$SLURM_NODEID \
    ARGS="$RECIPE extract.run_dir=$DSPARK_RUNS/extract-node$SLURM_NODEID"'
make verify ARGS="$RECIPE"

# 3. Training: one torchrun per node, joined by a c10d rendezvous on the first node.
on_every_node 'make train GPUS=$GPUS NODES=$NODES NODE_RANK=$SLURM_NODEID MASTER_ADDR=$MASTER_ADDR \
    MASTER_PORT=$MASTER_PORT ARGS="$RECIPE"'
