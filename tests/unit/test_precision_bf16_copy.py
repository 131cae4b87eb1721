"""precision.to_bfloat16 casts each weight straight into the copy (no float32 deep copy first): the copy equals
the deep-copy-then-cast it replaces bit for bit, shares nothing with the original, keeps tied weights tied and
forward hooks, and the process's peak while making it grows by the bfloat16 weights only."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import torch

from relserve.service.backends.precision import to_bfloat16


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 50, bias=False)
        self.out.weight = self.emb.weight  # tied, as a language-model head
        self.register_buffer("scale", torch.full((16,), 0.5))
        self.register_buffer("index", torch.arange(16))
        self.seen: list[torch.dtype] = []  # a forward hook's record (the copy's hook is the same function)
        self.register_forward_hook(lambda _m, _i, out: self.seen.append(out.dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.emb(ids)) * self.scale
        return self.out(h[..., self.index])


def test_copy_matches_deepcopy_then_cast_and_shares_nothing():
    torch.manual_seed(0)
    model = Tied().eval()
    old = copy.deepcopy(model).to(torch.bfloat16)
    new = to_bfloat16(model)
    ids = torch.randint(0, 50, (3, 7))
    with torch.inference_mode():
        assert torch.equal(new(ids), old(ids))
    assert model.seen == [torch.bfloat16, torch.bfloat16]  # the hook came along to both copies
    assert new.out.weight is new.emb.weight  # still tied
    assert all(p.dtype == torch.bfloat16 for p in new.parameters()) and new.scale.dtype == torch.bfloat16
    assert new.index.dtype == torch.int64 and new.index.data_ptr() != model.index.data_ptr()
    assert all(p.dtype == torch.float32 for p in model.parameters()) and model.scale.dtype == torch.float32
    ours = {t.untyped_storage().data_ptr() for t in (*new.parameters(), *new.buffers())}
    theirs = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    assert not ours & theirs
    # a bfloat16 model's copy is a copy too (a cast to the same dtype would return the same tensor)
    again = to_bfloat16(new)
    assert not {t.untyped_storage().data_ptr() for t in again.parameters()} & ours
    assert all(isinstance(p, torch.nn.Parameter) for p in again.parameters())


def test_peak_grows_by_the_bfloat16_weights_only():
    """In a fresh process (its peak RSS reset before the copy, /proc/self/clear_refs): a 64 MB float32 model's
    copy raises the peak by about its 32 MB of bfloat16, where a float32 deep copy first would add 64 MB more."""
    script = textwrap.dedent("""
        import re, torch
        from relserve.service.backends.precision import to_bfloat16
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)])  # 64 MiB fp32
        status = lambda key: int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10
        before = status("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
        copy = to_bfloat16(model)
        print(status("VmHWM") - before)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    grown = int(out.split()[-1])
    assert 30 << 20 <= grown < 60 << 20, grown
