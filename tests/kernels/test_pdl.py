"""The PDL switch (kernels/pdl.py): which launches ask for programmatic dependent launch."""

from __future__ import annotations

import pytest
import torch

from kernels import pdl

GPU = torch.device("cuda", 0)


@pytest.fixture
def sm90(monkeypatch):
    """A device that reports sm_90, without CUDA: the capability cache is what pdl_ok consults."""
    monkeypatch.setitem(pdl._DEVICES, GPU, True)


@pytest.mark.parametrize("enabled,small,int4,meta", [
    (True, True, True, {"USE_PDL": True, "launch_pdl": True}),  # SPECGATE_PDL=1 (the default)
    (True, False, True, {"USE_PDL": False}),  # SPECGATE_PDL=int4: the INT4 kernels alone
    (False, False, False, {"USE_PDL": False}),  # SPECGATE_PDL=0
])
def test_modes(sm90, monkeypatch, enabled, small, int4, meta) -> None:
    monkeypatch.setattr(pdl, "ENABLED", enabled)
    monkeypatch.setattr(pdl, "SMALL", small)
    assert pdl.pdl_ok(GPU) is int4
    assert pdl.pdl_meta(GPU) == meta


def test_never_on_the_cpu_or_before_sm90(monkeypatch) -> None:
    assert pdl.pdl_meta(torch.device("cpu")) == {"USE_PDL": False} and not pdl.pdl_ok(torch.device("cpu"))
    monkeypatch.setitem(pdl._DEVICES, GPU, False)  # an sm_80 card
    assert pdl.pdl_meta(GPU) == {"USE_PDL": False} and not pdl.pdl_ok(GPU)
