"""The torch.distributed transport (gloo/NCCL): point-to-point (transport), group means (mean)."""
