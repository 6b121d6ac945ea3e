"""The optimizers, at their public path ``psring.optim`` (they live in psring.core.optim).

The same code runs locally over the ring and inside the parameter-server shards over
ps, which is why it sits in the bottom layer: the shards import it too.
"""

from .core.optim import SGD, Adam, AdamW, Optimizer

__all__ = ["SGD", "Adam", "AdamW", "Optimizer"]
