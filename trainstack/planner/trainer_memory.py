"""What the trainer (training_image/trainer) holds in GPU memory, as the planner counts it.

The planner's memory model (trainstack.planner) is arithmetic over the model shape; the terms here are
the ones that depend on how *our* trainer is written: which tensors one block saves for backward, what
the activation-checkpointing policies keep and recompute, and which FSDP units are gathered at once.
They live next to each other so that a change to the trainer's model, checkpointing or FSDP wrapping
has exactly one place to change in the planner. tests/trainer/test_trainer_memory.py counts the real
block's saved tensors (saved-tensor hooks and live storages, deduplicated by storage, at their dtype
sizes) for several shapes and every mode, and the FSDP units gathered after forward, against this
module: a change to model.py that the formulas do not follow fails there.

What is counted is the pure-PyTorch block (the one a CPU can count; it is also the GPU path without
Transformer Engine and the op-level selective path). The Transformer Engine block saves different
tensors, which cannot be counted here: its fused modules save their inputs and the normalised input
once per module (in FP8, one byte per element, when FP8 is on), `LayerNormMLP` keeps fc1's output
and the activation's output, and `DotProductAttention` keeps Q, K, V, its output and the softmax
statistics. In BF16 that comes to about the same bytes as below; under FP8 a few h and ffn terms drop
to one byte. bench/trainer_gpu.py measures the TE block's memory where TE is installed.

No third-party imports: the training image imports trainstack modules too.
"""

from __future__ import annotations

from trainstack.recipes.schema import ModelShape

BF16 = 2
FP32 = 4

# --- FSDP units in flight (training_image/trainer/distributed/parallel.py) -------------------------------
# Units: the embedding, each block, and [final norm + output head] (one [embedding, norm, head] unit
# when tied). At the step's peak (the start of backward) the head unit and the last block are
# gathered (neither reshards after forward); the embedding is resharded until the end of backward.
# Two blocks are unsharded at once in backward (the one computing, the next one prefetched); each
# holds BF16 parameters, a BF16 gradient and the FP32 copy FSDP2 makes for the reduce-scatter.
BLOCKS_IN_FLIGHT = 2
BLOCK_IN_FLIGHT_BYTES = BF16 + BF16 + FP32
# Bytes per *embedding parameter* (ModelShape.embedding_params: embedding + head, one matrix when
# tied) that the head unit holds at the peak. Untied: the head's vocab x hidden matrix with BF16
# parameters, BF16 gradient and its FP32 reduce-scatter copy (8 bytes) = 4 bytes x (2 x vocab x
# hidden). Tied: the shared matrix's BF16 parameters and BF16 gradient (4 bytes); its FP32 copy is
# made only after the embedding's own backward, at the very end, when activations are freed. So 4
# per embedding parameter in both cases (head_unit_in_flight_bytes is the same figure, spelled out).
ROOT_IN_FLIGHT_BYTES = 4
# Cross-entropy over one chunk of logits, per token per vocabulary entry, at its backward peak: the
# saved FP32 log-softmax (4), the FP32 gradient of the log-probabilities (4) and of the logits (4).
LOSS_BYTES = 12


def _kv(m: ModelShape) -> int:
    return m.kv_dim


def head_unit_in_flight_bytes(m: ModelShape) -> int:
    """Bytes the [norm, output] unit (or the tied [embedding, norm, output] unit) holds unsharded at
    the start of backward (the final norm's `hidden` parameters are left out: negligible)."""
    matrix = m.vocab * m.hidden
    if m.tied_embeddings:
        return matrix * (BF16 + BF16)
    return matrix * (BF16 + BF16 + FP32)


def fsdp_units_in_flight_bytes(m: ModelShape) -> int:
    """Unsharded parameters, gradients and reduce-scatter copies at the step's peak, per GPU."""
    return BLOCKS_IN_FLIGHT * m.params_per_layer * BLOCK_IN_FLIGHT_BYTES + head_unit_in_flight_bytes(m)


def gathered_parameter_bytes_after_forward(m: ModelShape) -> int:
    """BF16 parameters still gathered when forward ends (what the FSDP-unit test measures): the last
    block and the head unit (its norm included); the embedding and every other block are resharded."""
    head = m.vocab * m.hidden + m.hidden
    return BF16 * (m.params_per_layer + head)


# --- what one block saves for backward, bytes per token -------------------------------------------
def block_activation_bytes(m: ModelShape) -> int:
    """Bytes per token one block (training_image/trainer/models/model.py, pure PyTorch) saves for backward
    without checkpointing, tensor by tensor (h hidden, q = heads x head_dim, which is h unless the
    shape sets head_dim, kv = kv_heads x head_dim, H heads, f ffn):

    attention  block input for the RMSNorm (2h) and its FP32 1/rms (4); the normalised input, Q/K/V's
               input (2h); RoPE'd q (2q) and k (2kv) and the copy of v (2kv), which attention saves,
               with its output (2q) and FP32 log-sum-exp (4H); the output projection reads attention's
               output as a view (no second copy). A Q/K/V bias (Qwen2) saves nothing more: its
               gradient is a sum over tokens of the output's gradient
    MLP        residual for the RMSNorm (2h) and its FP32 1/rms (4); the normalised input, fc1's input
               (2h); fc1's output [gate, up] (4f, kept by SiLU and by the product); SiLU's output (2f);
               the product, fc2's input (2f)

    = 8h + 4q + 4kv + 8f + 4H + 8 (12h + 4kv + 8f + 4H + 8 when q = h). (Before this trainer kept
    RoPE'd q, k and v apart from the fused Q/K/V output and read attention's output through a copy it
    came to about 14h + 4kv + 8f.)
    """
    h, q, kv, f = m.hidden, m.q_dim, _kv(m), m.ffn
    attention = BF16 * (h + h + q + kv + kv + q) + FP32 * (1 + m.heads)
    mlp = BF16 * (h + h + 2 * f + f + f) + FP32
    return attention + mlp


def full_checkpoint_bytes(m: ModelShape) -> int:
    """A fully checkpointed block keeps only its BF16 input (the checkpoint's argument)."""
    return BF16 * m.hidden


def op_selective_bytes(m: ModelShape) -> int:
    """Bytes per token a block keeps under op-level selective checkpointing
    (trainer/models/activation_checkpointing.py: attention's outputs and every other matmul's saved): the
    block input (2h), the fused Q/K/V output (2q + 4kv), attention's output (2q) and FP32 log-sum-exp
    (4H), fc1's output (4f). = 2h + 4q + 4kv + 4f + 4H (6h + ... when q = h)."""
    h, q, kv, f = m.hidden, m.q_dim, _kv(m), m.ffn
    return BF16 * (h + (q + 2 * kv) + q + 2 * f) + FP32 * m.heads


def block_saved_bytes(m: ModelShape, mode: str) -> int:
    """Bytes per token one block keeps for backward: mode none | full | op."""
    return {"none": block_activation_bytes, "full": full_checkpoint_bytes, "op": op_selective_bytes}[mode](m)


# --- context parallelism (training_image/trainer/distributed/context_parallel.py, pure PyTorch) ---
def context_parallel_block_saved_bytes(m: ModelShape, mode: str, cp: int) -> int:
    """Bytes per *local* token (seq_len / cp of each sequence) one block keeps under context
    parallelism. Without checkpointing attention keeps the all-gathered K and V (cp x the local ones:
    2 x 2kv x cp bytes per local token) instead of the local copies; the local RoPE'd k and the copy of
    v are the gather's inputs, which its backward does not need. A fully checkpointed block keeps its
    input; under the op policy attention's output is saved and its inputs (the gathered K/V) are
    recomputed, so the gather runs again in backward and nothing more is kept. At cp 1 the same as
    `block_saved_bytes`."""
    extra = BF16 * 2 * m.kv_dim * (cp - 1) if mode == "none" else 0
    return block_saved_bytes(m, mode) + extra


def context_parallel_mask_bytes(seq_len: int, cp: int, dtype_bytes: int = BF16) -> int:
    """The pure-PyTorch path's additive causal mask, (seq_len / cp) x seq_len in the compute dtype,
    made once and shared by every block (Transformer Engine's CP attention needs none)."""
    return (seq_len // cp) * seq_len * dtype_bytes if cp > 1 else 0


# --- what recompute costs, as a share of one block's forward matmul FLOPs ---------------------------
def _block_matmul_terms(m: ModelShape) -> dict[str, int]:
    """Forward multiply-accumulates per token of each of the block's four matmuls."""
    h, q, kv, f = m.hidden, m.q_dim, _kv(m), m.ffn
    return {"qkv": h * (q + 2 * kv), "proj": q * h, "fc1": h * 2 * f, "fc2": f * h}


def op_selective_recompute_share(m: ModelShape) -> float:
    """Share of a block's matmul FLOPs the op-level policy recomputes: the output projection only
    (Q/K/V and fc1 are saved; fc2 is never replayed, see activation_checkpointing). No attention
    forward is recomputed (its outputs are saved)."""
    terms = _block_matmul_terms(m)
    return terms["proj"] / sum(terms.values())


def full_recompute_share(m: ModelShape, backend: str = "pytorch") -> float:
    """Share of a block's matmul FLOPs a fully checkpointed block recomputes (its attention forward is
    recomputed too). torch's non-reentrant checkpoint stops once fc2's input is rebuilt, so fc2 is not
    replayed; Transformer Engine's checkpoint has no early stop (its docs) and replays all four."""
    if backend == "transformer_engine":
        return 1.0
    terms = _block_matmul_terms(m)
    return (terms["qkv"] + terms["proj"] + terms["fc1"]) / sum(terms.values())


# --- torchtitan's Llama 3 block, for calibrating the planner against its published runs ---------------
# Not this trainer: torchtitan's block has separate wq, wk, wv, wo, w1, w3, w2 matmuls, so its op-level
# policy ("save every other matmul") keeps a different set than ours (see op_selective_bytes). The
# planner's calibration cases (torchtitan runs with selective op checkpointing) should use these; the
# trainer's own recipes use op_selective_bytes / op_selective_recompute_share.
def torchtitan_op_selective_bytes(m: ModelShape) -> int:
    """torchtitan's op-level policy keeps, in BF16, the block input, every other matmul output (wq, wv,
    w1, w2 of wq wk wv wo w1 w3 w2) and the attention output: 2 * (4h + kv + ffn) bytes per token."""
    return BF16 * (4 * m.hidden + _kv(m) + m.ffn)


def torchtitan_op_selective_recompute_share(m: ModelShape) -> float:
    """Share of torchtitan's block matmul FLOPs its op-level policy recomputes (wk, wo, w3)."""
    kv = _kv(m)
    recomputed = m.hidden * kv + m.hidden * m.hidden + m.hidden * m.ffn
    total = m.hidden * (2 * m.hidden + 2 * kv) + 3 * m.hidden * m.ffn
    return recomputed / total


# --- the step's peak: the moment it falls at (checked against the traced step, bench/trace_vs_plan.py) ---
# The trace of the trainer's own step (training_image/trainer/trace) shows the peak at one of two
# moments, never at both: the chunked loss's backward (the head's gradient being built, every block's
# activations still saved), or a block's backward (its recompute and gradients, the FSDP units around
# it). The planner used to add both moments' transient terms together and over-counted by 4.5 GiB on
# an 8B model (bench/trace_vs_plan.py --layers 4: +23% to +47% before, issue 39).
#
# At the loss's backward: the head matrix gathered in BF16 and its BF16 gradient being accumulated
# chunk by chunk (4 bytes per head parameter, tied or not), the last block's BF16 parameters (kept
# gathered after forward), one chunk's logits (LOSS_BYTES), and per token the final RMSNorm's saved
# input and output (2 x 2h) and the BF16 gradient of the final hidden states (2h).
FINAL_HIDDEN_BYTES = 3 * BF16


# In a block's backward, beyond what it recomputes: the BF16 gradient of fc1's output [gate, up] (4f),
# alive while SwiGLU's backward runs (the trace of blocks of six shapes: within 0.5% of a block's
# working set; the rest is the block's own unsharded weight gradients).
def block_gradient_working_bytes(m: ModelShape) -> int:
    return BF16 * 2 * m.ffn


def ffn_weight_gradient_bytes(m: ModelShape) -> int:
    """The MLP's unsharded BF16 weight gradients (fc1 2f x h, fc2 f x h), made during the MLP's backward,
    where a block's backward peaks; reduced after the block's backward."""
    return BF16 * 3 * m.ffn * m.hidden


def fc1_weight_gradient_bytes(m: ModelShape) -> int:
    """fc1's (the fused gate and up projections, 2f x h) share of `ffn_weight_gradient_bytes`."""
    return BF16 * 2 * m.ffn * m.hidden


def loss_backward_in_flight_bytes(m: ModelShape) -> int:
    """Unsharded bytes at the loss's backward: head matrix BF16 parameters + BF16 gradient, and the last
    block's BF16 parameters."""
    return m.vocab * m.hidden * (BF16 + BF16) + m.params_per_layer * BF16


def top_block_backward_in_flight_bytes(m: ModelShape) -> int:
    """Unsharded bytes while an upper block runs backward (every other block's activations still
    saved): its BF16 parameters, the next one's (prefetched), and the FP32 reduce-scatter input of the
    unit above, which FSDP2 keeps until this block's reduce-scatter (`reduce_scatter_states`, at most
    `reduce_scatter_max_input_buffers` = 1 in flight): 2 + 2 + 4 bytes per block parameter at the
    last but one block (traced: 64B blocks at FSDP 64); at the last block the unit above is the
    untied [norm, output], 4 bytes per head parameter (traced: 8B at 4 blocks with full checkpointing,
    1.96 GiB of it). Whichever is larger. Tied, the unit above the last block is [embedding, norm,
    output], which reduces and reshards only after the embedding's backward at the very end, so the
    block above counts, and the shared matrix is held unsharded in BF16 with its BF16 gradient
    (traced: 3B at 4 blocks, 0.73 GiB of each; torch's stock tracker, which runs a grouped unit's
    hooks per module, had resharded the parameters after the head's backward)."""
    tied = m.vocab * m.hidden * (BF16 + BF16) if m.tied_embeddings else 0
    head_unit = 0 if m.tied_embeddings else m.vocab * m.hidden + m.hidden
    above = max(m.params_per_layer, head_unit)
    return BLOCKS_IN_FLIGHT * m.params_per_layer * BF16 + above * FP32 + tied


def bottom_block_backward_in_flight_bytes(m: ModelShape) -> int:
    """Unsharded bytes while block 0 runs backward: its BF16 parameters, block 1's FP32 reduce-scatter
    input (FSDP2 frees it at the next unit's reduce-scatter), and the embedding's BF16 all-gather,
    prefetched for the last backward (tied: with the shared matrix's BF16 gradient still held)."""
    embedding = m.vocab * m.hidden * (BF16 + BF16 if m.tied_embeddings else BF16)
    return m.params_per_layer * (BF16 + FP32) + embedding
