"""The value-checked bad inputs of tests/test_bad_inputs.py run on CUDA without
ADAATTN_CHECK_INPUTS: no host sync, so the kernels clamp the values (seqlens, cu_seqlens,
block lists, cache lengths, page tables) instead of refusing them. Under compute-sanitizer the
run must be memcheck-clean: nothing a bad value says is read or written out of bounds.

    compute-sanitizer --tool memcheck python benchmarks/sanitize_bad_inputs.py
"""
import os
import sys

import torch

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [root, os.path.join(root, "tests")]
os.environ.pop("ADAATTN_CHECK_INPUTS", None)

import test_bad_inputs  # noqa: E402


def main():
    ran = raised = 0
    for case in test_bad_inputs.BAD:
        if not case.values:
            continue
        ran += 1
        try:
            out = case.call("cuda")
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.float().sum().backward()
        except Exception:  # noqa: BLE001 - a check that needs no sync may still refuse it
            raised += 1
        torch.cuda.synchronize()
    print(f"sanitize_bad_inputs: {ran} value cases on CUDA ({raised} refused without a sync)")


if __name__ == "__main__":
    main()
