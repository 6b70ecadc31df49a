"""Device check for the replica check's non-finite flag on a CUDA model (one process, no world).

Fingerprints a CUDA MLP and its Adam state, writes a NaN and then an Inf into one tensor,
and prints whether the flag and the per-entry look name it; also the fingerprint's time.
    python bench/sdc_gpu_check.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from elastic.consistency.fingerprint import METHOD, fingerprint, nonfinite_entries  # noqa: E402
from elastic.consistency.inject import poison, target  # noqa: E402
from elastic.consistency.vote import vote  # noqa: E402


def main() -> int:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4)).to(dev)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(64, 1024, device=dev)).sum().backward()
    opt.step()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, method {METHOD}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
    clean = fingerprint(model, opt, {"ema": torch.zeros(4, device=dev)})
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fingerprint(model, opt, None)
        times.append(time.perf_counter() - t)
    print(f"clean: finite={clean.finite}; fingerprint median {sorted(times)[5] * 1e3:.2f} ms")
    ok = clean.finite
    for kind, what in (("nan", "2.weight"), ("inf", "4.bias.exp_avg_sq")):
        t = target(model, opt, what)
        saved = t.detach().clone()
        poison(t, kind)
        fp = fingerprint(model, opt, None)
        names = nonfinite_entries(model, opt, None)
        v = vote([clean.digests(), fp.digests()], [not clean.finite, not fp.finite])  # nonfinite flags
        print(f"{kind} in {what}: finite={fp.finite} entries={names} verdict suspects={v.suspects} "
              f"majority={v.majority}")
        ok = ok and not fp.finite and names == [what] and v.suspects == (1,)
        with torch.no_grad():
            t.copy_(saved)
    ok = ok and fingerprint(model, opt, None).finite
    print("DEVICE CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
