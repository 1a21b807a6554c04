"""Accuracy evaluation on a real model: a paged runner for Hugging Face models, the evaluation and its corpus."""
