"""Linear attention (docs/ops.md): kernelised attention with a feature map, causal (chunked scan)
or not, dense or packed, with an optional carried state; forward and backward on CPU and CUDA."""
from typing import Optional, Tuple, Union

import torch

from . import _checks as C
from ._ops import ops


def linear_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, feature_map: str = "elu",
                causal: bool = True, normalize: bool = True,
                cu_seqlens: Optional[torch.Tensor] = None,
                initial_state: Optional[torch.Tensor] = None, return_state: bool = False
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Linear attention ``o_t = phi(q_t) S_t / (phi(q_t) . z_t)``.

    ``S_t = S0 + sum_{s <= t} phi(k_s)^T v_s`` and ``z_t = z0 + sum_{s <= t} phi(k_s)`` (all ``s``
    of the sequence when not ``causal``: ``phi(Q) (phi(K)^T V)``); without ``normalize`` the output
    is ``phi(q_t) S_t``. A row whose normaliser ``phi(q_t) . z_t`` is exactly 0 gives 0 (with
    ``relu`` its numerator is 0 too) and zero gradients. Causal rows are computed in chunks of 64
    (masked intra-chunk product plus the state carried between chunks), ``O(T C D + T D Dv)``.

    The state is one tensor, ``z`` appended to ``S`` as a last column when ``normalize`` (it is the
    state of ``[v | 1]``): ``[N, H, D, Dv + 1]`` (``[N, H, D, Dv]`` without ``normalize``), float32
    (float64 for float64 inputs), N = B for dense inputs and the number of sequences for packed
    ones. A final state can be passed back as the next call's ``initial_state``.

    Precision: CPU computes in double internally; CUDA float32/float64 inputs take the exact
    scan kernel (state in double). CUDA float16/bfloat16 with ``D`` and ``Dv`` in {64, 128} run
    tensor-core kernels: MMA operands (``phi(q)``, ``phi(k)``, v, the intra-chunk weights and the
    states as read by a chunk) are rounded to the input dtype, every product accumulates in
    float32, and states and the normaliser are float32. Other float16/bfloat16 shapes, and the
    CPU, compute in float32 (inputs upcast, output cast back).

    Args:
        q: ``[B, H, T, D]``; packed: ``[T, H, D]`` with ``cu_seqlens``. Any strides with a
            contiguous last dim (e.g. a ``(B, T, H, D)`` tensor passed as ``.transpose(1, 2)``).
        k: q's shape (as many kv heads as query heads: no GQA).
        v: ``[B, H, T, Dv]``; packed ``[T, H, Dv]`` (``Dv`` may differ from ``D``; both <= 256).
        feature_map: ``"elu"`` (``elu(x) + 1``), ``"relu"`` or ``"identity"``.
        causal: causal (default) or full (non-causal) attention.
        normalize: divide by ``phi(q_t) . z_t`` (default) or not.
        cu_seqlens: int32 ``[N + 1]`` boundaries of the packed sequences (non-decreasing, from 0
            to T; zero-length sequences allowed); each sequence starts from its own state.
        initial_state: ``[N, H, D, Dv + normalize]`` in the state dtype (see above); zeros when
            absent. Receives a gradient when it requires one.
        return_state: also return the final state.

    Returns:
        ``out`` (v's shape, q's dtype), or ``(out, state)`` when ``return_state``; gradients flow
        from both to q, k, v and ``initial_state``.

    Raises:
        TypeError: a flag that is not a bool, feature_map not a str; q, k, v not floating or not
            of one dtype, cu_seqlens not int32, initial_state not of the state dtype.
        ValueError: a wrong shape, layout or value (ranks, k not of q's shape, head dims,
            unknown feature_map, initial_state's shape, cu_seqlens not ``[N + 1]``, not starting
            at 0, decreasing or not ending at ``T`` (values: CPU; CUDA with
            ``ADAATTN_CHECK_INPUTS=1``)).
        RuntimeError: tensors on different devices.
        Every message starts ``adaattn.linear_attn:`` and names the argument.
    """
    op = "linear_attn"
    C.tensors(op, q=q, k=k, v=v)
    C.optional_tensors(op, cu_seqlens=cu_seqlens, initial_state=initial_state)
    return_state = C.boolean(op, "return_state", return_state)
    C.check(isinstance(feature_map, str), TypeError, op, "feature_map must be a str, got ",
            C.type_name(feature_map))
    out, state = ops.linear_attn(q, k, v, initial_state, cu_seqlens, feature_map,
                                 C.boolean(op, "causal", causal),
                                 C.boolean(op, "normalize", normalize))
    return (out, state) if return_state else out
