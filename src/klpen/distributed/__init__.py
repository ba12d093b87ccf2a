r"""Vocab-parallel log-probs and full KL over ``torch.distributed``, without gathering logits.

Chapter 11 of the book. In tensor-parallel training the output projection is split by columns:
rank ``r`` of a process group holds the logits ``z[..., V_r]`` of a contiguous slice ``V_r`` of
the vocabulary, the slices in rank order. Gathering the full logits to call
:func:`~klpen.get_logprobs_for_tokens` or :func:`~klpen.full_kl` would need ``B·T·V`` numbers
on every rank; both quantities only need a few numbers per row from each rank.

Each rank reduces its own slice, block by block, with the single-process kernels, to per-row
statistics: its local log-sum-exp ``a_r = lse(z[V_r])`` (and ``b_r = lse(w[V_r])`` for the
reference), the logit of the target token when the rank owns it, and the KL of the two softmaxes
*restricted* to its slice, ``KL_r``. With ``m = max_r a_r`` and ``S = sum_r exp(a_r - m)``:

.. math::

    \begin{aligned}
    \mathrm{lse}(z) &= m + \log S, \\
    \log \pi(y) &= z_y - \mathrm{lse}(z),
    \end{aligned}

and with ``π_r = exp(a_r - lse(z))`` and ``ρ_r = exp(b_r - lse(w))``, the mass of slice ``r``
under the policy and the reference, the chain rule of the KL divergence gives

.. math:: \mathrm{KL}(p \,\|\, q)
    = \sum_r \pi_r \mathrm{KL}_r + \sum_r \pi_r \log \frac{\pi_r}{\rho_r},

two non-negative parts; the second, the KL of the slice masses, is formed in the centred form
of :func:`klpen.full_kl` from the slices' log-ratios ``b_r - a_r = KL_r - E_{p_r}[d]``, which
carry no offset of the logits, so that divergences down to ``1e-9`` keep their digits.

Both take ``temperature=`` (the distributions are then ``softmax(z / T)``), as their
single-process counterparts do. The log-prob keeps the global log-sum-exp split as
``max + log S`` (each slice shifted by its own row max), so that a large common offset of the
logits costs no digits.

:func:`aggregate` is the data-parallel counterpart of :func:`klpen.aggregate` (padded or packed
rows, the peers' aliases), and :func:`mismatch_metrics` that of :func:`klpen.mismatch_metrics`:
each rank holds other rows of the batch, and the token counts, sums, maxima and minima are made
global.

Failure on one rank is failure on every rank, and so is disagreement: the metadata every rank sends
first (its slice size, leading shape, dtypes, hidden size, temperature, announced vocabulary size)
is compared, and ranks that differ in any of it raise on every rank a ``ValueError`` naming what
differs and the values; token ids are compared exactly. Every input is checked before the first
collective; what can still fail afterwards (the local block computation) is caught, and a flag
travels with the next collective, so that every rank raises — the rank that failed its own error,
the others an error that names it and repeats its message — and no rank is ever left waiting in a
collective that its peers will not join.


Communication per forward call (``N`` = number of rows, i.e. the product of the leading
dimensions; floats in the compute dtype, fp32 for half-precision input; ``+1``: the failure
flag):

* ``vocab_parallel_logprobs``: one all-gather of 16 ``int64`` metadata per rank, one
  all-reduce (max) of ``3·N + 1`` floats (the slices' row maxima and the token ids and their
  negatives, which compares the tokens of all ranks exactly), one all-reduce (sum) of
  ``2·N + 1`` floats;
* ``vocab_parallel_full_kl``: one all-gather of 16 ``int64`` metadata per rank, one all-gather
  of ``4·N + 1`` ``float64`` per rank (each slice's two log-sum-exps, restricted KL and
  ``E[d]``: every rank then combines the same numbers);
* ``vocab_parallel_linear_logprobs``: see :func:`vocab_parallel_linear_logprobs`;
* ``aggregate``: one all-gather of 6 ``float64`` per rank;
* ``mismatch_metrics``: one all-gather of 12 ``float64`` per rank.

(Vocabularies beyond ``2**24`` ids with fp32 logits send each id as two or more exact digits.) An
error adds one ``all_gather_object`` of the failing ranks' messages. The backward passes of the two
logits forms communicate nothing: each rank recomputes the softmax of its own slice per block from
the saved local logits and the global per-row statistics.


The package's modules: ``_protocol`` (groups, metadata, failure flags, token agreement; imports
only :mod:`klpen._validation`), ``_kernels`` (the single-process kernels used here, imported in
this one place), ``_vocab_parallel`` (log-probs and full KL from logits), ``_linear`` (log-probs
from hidden states and a sharded output layer), ``_aggregate`` (data-parallel aggregation) and
``_mismatch`` (data-parallel mismatch metrics).
"""

from __future__ import annotations

from ._aggregate import aggregate
from ._linear import vocab_parallel_linear_logprobs
from ._mismatch import mismatch_metrics
from ._vocab_parallel import vocab_parallel_full_kl, vocab_parallel_logprobs

__all__ = [
    "aggregate",
    "mismatch_metrics",
    "vocab_parallel_full_kl",
    "vocab_parallel_linear_logprobs",
    "vocab_parallel_logprobs",
]
