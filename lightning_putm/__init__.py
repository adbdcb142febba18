"""lightning-putm: class-imbalanced transductive few-shot learning with PUTM (Tian et al., ICCV 2023)."""

import os

#: MKL's conditional numerical reproducibility mode, set unless the environment already names one. Without it MKL
#: may pick its CPU kernels by a matrix's memory alignment, so a task's result would depend on where the task sits
#: in a batch (measured on an AMD EPYC of family 26: ``torch.linalg.inv`` and UNEM's small batched products rounded
#: differently alone and in a batch). MKL reads it at its first call, so it must be set before torch computes
#: anything with MKL: importing this package first does that.
MKL_REPRODUCIBILITY = "AUTO,STRICT"
os.environ.setdefault("MKL_CBWR", MKL_REPRODUCIBILITY)

__version__ = "0.1.0"
