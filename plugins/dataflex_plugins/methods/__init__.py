"""Implementations of the first-party methods (import torch)."""
