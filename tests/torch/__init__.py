"""Tests of psring/torch/: psring under PyTorch: the integration and the torch.distributed backend."""
