"""kvfast's peer adapter against the peers' naive pure-Python adapter, interleaved in one process.

Without the peer venv (vLLM) the whole-lifecycle ratio to vLLM cannot be
measured here; this script measures kvfast / naive in one run, and
``RESULTS.md`` of the peers folder gives naive / vLLM (0.35-0.39 over three
interleaved runs), so kvfast / vLLM ~= (kvfast / naive) x (naive / vLLM).

    python benchmarks/peer_vs_naive.py [--requests 2000] [--reps 3] [--peers ../shared/peers]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peers", default=str(HERE.parent.parent / "shared" / "peers"))
    args = ap.parse_args(argv)
    sys.path[:0] = [args.peers, str(HERE)]
    import vllm_bookkeeping as vb
    from example_adapter import NaiveAdapter
    from kvfast_adapter import KvfastAdapter, KvfastXxh3Adapter

    wl = vb.make_workload(vb.SEED, args.requests)
    contenders = [("naive", NaiveAdapter), ("kvfast", KvfastAdapter), ("kvfast-xxh3", KvfastXxh3Adapter)]
    vb.run_once(lambda: KvfastAdapter(vb.BLOCK_SIZE, vb.NUM_BLOCKS), vb.make_workload(vb.SEED, 64))  # warm kernels
    runs = {n: [] for n, _ in contenders}
    for rep in range(args.reps):
        order = contenders if rep % 2 == 0 else contenders[::-1]
        for name, cls in order:
            r = vb.run_once(lambda: cls(vb.BLOCK_SIZE, vb.NUM_BLOCKS), wl)
            runs[name].append(r)
            print(f"  rep {rep + 1} {name:>12}: lifecycle {r['lifecycle_us_per_req']:.0f} us/req  "
                  f"admit+hash {r['admit_incl_hash_us_per_req']:.0f}  decode+append "
                  f"{r['decode_incl_append_us_per_req_step']:.2f}  free {r['free_us_per_req']:.1f}  "
                  f"hits {r['hit_tokens']}  peak {r['peak_blocks_used']}")
    keys = ["admit_incl_hash_us_per_req", "decode_incl_append_us_per_req_step", "free_us_per_req",
            "lifecycle_us_per_req", "hit_tokens", "peak_blocks_used"]
    med = {n: {k: statistics.median(r[k] for r in runs[n]) for k in keys} for n in runs}
    print(f"\nmedians of {args.reps} reps:")
    print(f"{'metric':<38}" + "".join(f"{n:>14}" for n in runs) + f"{'kvfast/naive':>14}")
    for k in keys:
        print(f"{k:<38}" + "".join(f"{med[n][k]:>14.2f}" for n in runs) + f"{med['kvfast'][k] / med['naive'][k]:>14.3f}")
    ratio = med["kvfast"]["lifecycle_us_per_req"] / med["naive"]["lifecycle_us_per_req"]
    ratio_x = med["kvfast-xxh3"]["lifecycle_us_per_req"] / med["naive"]["lifecycle_us_per_req"]
    print(f"\nestimated kvfast / vLLM lifecycle: {ratio * 0.35:.2f} - {ratio * 0.39:.2f} (sha256), "
          f"{ratio_x * 0.35:.2f} - {ratio_x * 0.39:.2f} (xxh3_128); naive / vLLM = 0.35-0.39 per RESULTS.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
