"""Models as torch modules: everything k3post does to a transformers model, in rooms by role.

Lowest first (a room imports only from rooms below it; `lint-imports` checks it):

    families.py   what each model family does to its logits after the output head (shared by all)
    batch_invariant.py  the batch-invariant mode (sampling.on_policy: bitwise): forwards whose values
                  per token do not depend on the batch, so sampler and learner agree bit for bit
    invariant_attention.py  its attention on GPUs: a Triton kernel, one program per query and head
    generation/   drawing tokens: the HF `generate` path, the static-cache CUDA-graph sampler,
                  speculative decoding and its draft head, the fused projections it runs on
    loading/      a recipe's model spec → a model and tokenizer (HF dirs, GGUF, tiny, pruned,
                  Kimi Linear), checked before any weight is read
    scoring/      log-probabilities of given tokens: chunked over the vocabulary, a shared prompt
                  prefix encoded once, each teacher's chat rendering
    training/     the learner's model surgery: FSDP2, sharded load and gathers, the reference in
                  the gradient buffers, train/eval modes, weights out to the samplers, MoE load
    quant/        FP8: torchao fake quantisation for QAT, the sampler's FP8 Linear, the FP8 sync
    tokenizers/   a teacher of another tokenizer: token ↔ text maps and the transplanted head
    export/       checkpoints for serving: compressed-tensors FP8, the MTP draft head (MiMo)

`loading` and `scoring` sit side by side and never import each other; so do `tokenizers` and
`export`. The one intended circle is `loading/load.py` ↔ `tokenizers/transplant.py` (a model
spec may name a transplanted tokenizer, and a transplant loads its donor). Nothing here imports
an engine, Ray or vLLM.
"""
