"""MKL's reproducibility mode (``MKL_CBWR``), which importing the package sets unless the environment names one.

Without it MKL may choose its CPU kernels by a matrix's memory alignment. Inside a batch a task's matrices start at
whatever offset the batch gives them; alone they are freshly allocated. On an AMD EPYC of family 26 (2026-11-28,
torch 2.14.1, MKL 2024.2) that made ``torch.linalg.inv`` (α-AM's propagator) and small batched products (UNEM's
logits) round differently alone and in a batch, and α-AM's 100 Adam steps turned it into 3 other predictions out of
300. MKL reads the variable at its first call, so each case runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

#: A fresh interpreter: imports the package (or not), then solves 4 tasks' MKL calls in one batch and one by one
CHILD = """
import json, sys
if sys.argv[1] == "torch first":  # a notebook that imports torch, then the package, then computes
    import torch
if sys.argv[1] in ("package", "torch first"):
    import lightning_putm
import os
import torch

torch.manual_seed(0)
# alone each matrix is freshly allocated; in the batch they start 85 * 85 * 4 bytes apart (not 64-byte aligned)
matrices = torch.eye(85) + 0.1 * torch.rand(4, 85, 85)
inverse = torch.linalg.inv(matrices)
alone = torch.cat([torch.linalg.inv(matrices[i:i + 1]) for i in range(4)])
# UNEM's logits: [T, 75, 16] x [T, 16, 5] (the class sums X^T W, contiguous)
query, protos = torch.randn(4, 75, 16), torch.randn(4, 16, 5)
product = query.bmm(protos)
product_alone = torch.cat([query[i:i + 1].bmm(protos[i:i + 1]) for i in range(4)])
print(json.dumps({"mode": os.environ.get("MKL_CBWR"), "inverse": torch.equal(inverse, alone),
                  "product": torch.equal(product, product_alone)}))
"""


def run_child(code: str, argument: str, **env: str) -> dict[str, object]:
    """``code`` in a fresh interpreter with ``argument``, the environment without ``MKL_CBWR`` but for ``env``; the
    JSON it prints last."""
    environment = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | env
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code, argument], env=environment, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(imports: str, **env: str) -> dict[str, object]:
    return run_child(CHILD, imports, **env)


def test_importing_the_package_sets_mkl_reproducibility_and_keeps_a_users_choice() -> None:
    """Kills: the mode not set, set after torch's first MKL call (too late), or a user's value overwritten."""
    assert child("package")["mode"] == "AUTO,STRICT"
    assert child("package", MKL_CBWR="COMPATIBLE")["mode"] == "COMPATIBLE"


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch is built without MKL")
def test_a_task_gets_the_same_bits_from_mkl_alone_and_in_a_batch() -> None:
    """With the package imported, an inverse and a batched product give each task the same bits alone and in a
    batch. Kills the mode not set, on CPUs where MKL's kernels depend on alignment (the one above: there, without
    the package, neither is the same; on others both may be the same without it)."""
    with_package = child("package")
    assert with_package["inverse"] and with_package["product"]
    without = child("torch only")
    assert without["mode"] is None
    torch_first = child("torch first")
    assert torch_first["mode"] == "AUTO,STRICT" and torch_first["inverse"] and torch_first["product"]


#: A fresh interpreter: imports torch, computes with MKL (or not), then imports the package; prints its warnings
#: and the MKL mode in effect
LATE_CHILD = """
import json, sys, warnings
import torch
if sys.argv[1] == "computed":
    torch.linalg.inv(torch.eye(8) + 0.1 * torch.rand(8, 8))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import lightning_putm
    from lightning_putm.reproducibility import mkl_mode_reader
read = mkl_mode_reader()
print(json.dumps({"warnings": [str(w.message) for w in caught if w.category.__name__ == "MKLReproducibilityWarning"],
                  "mode": read() if read else None}))
"""


def late_child(computed: bool, **env: str) -> dict[str, object]:
    return run_child(LATE_CHILD, "computed" if computed else "imported", **env)


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch is built without MKL")
def test_importing_the_package_after_torch_computed_says_the_mode_is_off_and_how_to_fix_it() -> None:
    """MKL fixes its mode at its first computation: a package imported later cannot set it, and says so once,
    with the fix. Kills: no check (a silent mode off), a warning whenever torch was imported first (it need not
    have computed), and a warning although the user chose a mode."""
    imported = late_child(computed=False)
    if imported["mode"] is None:
        pytest.skip("this torch's MKL does not export its mode (mkl_serv_cbwr_get)")
    assert imported["warnings"] == [] and imported["mode"] == 0x10002  # MKL_CBWR_AUTO | MKL_CBWR_STRICT
    computed = late_child(computed=True)
    assert computed["mode"] != 0x10002
    assert len(computed["warnings"]) == 1
    assert "Import lightning_putm before computing with torch" in computed["warnings"][0]
    assert "MKL_CBWR=AUTO,STRICT" in computed["warnings"][0]
    assert late_child(computed=True, MKL_CBWR="COMPATIBLE")["warnings"] == []
