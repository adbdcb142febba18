"""lightning-putm: class-imbalanced transductive few-shot learning with PUTM (Tian et al., ICCV 2023)."""

__version__ = "0.1.0"
