"""lightning-putm: class-imbalanced transductive few-shot learning with PUTM (Tian et al., ICCV 2023)."""

from lightning_putm.reproducibility import MKL_REPRODUCIBILITY, request_mkl_reproducibility

# before torch's first MKL computation, so that a task's result does not depend on the batch it is solved in
request_mkl_reproducibility()

__all__ = ["MKL_REPRODUCIBILITY", "__version__"]
__version__ = "0.1.0"
