"""Evaluation of exported drafters: offline acceptance on held-out shards, confidence
calibration, online speed in vLLM, reports and plots, the model card, vocabulary pruning."""
