"""compilemask as a Hugging Face transformers attention backend
(`attn_implementation="compilemask"`, compilemask.integrations.transformers) against
transformers' own `attn_implementation="sdpa"` on small random-initialised Llama- and
Qwen2-style models (GQA; Qwen2 with a sliding window), and against `"eager"` on gpt-oss
(learnable sinks) and Gemma 2 (logit soft-capping), no weights downloaded: logits, loss
and every parameter's gradient within the accuracy rule of docs/design.md, greedy
generation, packed documents (position_ids and cu_seq_lens) against each document alone,
left-padded batches, and a user program against a float64 dense reference. On CPU the
CPU reference runs (float32); on a Hopper GPU the kernels (bfloat16). Skips without torch
or transformers (>= 4.53). The GPU run:

    WHEEL=$(ls dist/compilemask-*.whl) USE_PYTHON_PACKAGES=1 scripts/test-python.sh \
        PYTEST_ARGS="-k transformers"
"""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
cmt = pytest.importorskip(
    "compilemask.integrations.transformers", reason="transformers < 4.53 (no AttentionMaskInterface)"
)

import compilemask as cm  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
# (device, dtype under test): the CPU reference in float32, the kernels in bfloat16.
TARGETS = [("cpu", torch.float32)] + ([("cuda", torch.bfloat16)] if HOPPER else [])
# The accuracy rule's absolute term per dtype.
ABS = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def configs():
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=256, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  attention_dropout=0.0)
    return {
        "llama": LlamaConfig(head_dim=64, **common),
        # Layer 1 uses a sliding window of 24 keys (max_window_layers = 1).
        "qwen2": Qwen2Config(use_sliding_window=True, sliding_window=24, max_window_layers=1,
                             **common),
    }


CONFIGS = ["llama", "qwen2"]


def scored_configs():
    """Models whose attention calls pass score terms, each with the attention it is compared
    against (transformers' eager attention, the one that applies them): gpt-oss (learnable
    sinks, `s_aux`; a sliding-window layer and a full one; its experts in eager loops, which
    run in float64) and Gemma 2 (logit soft-capping, `softcap`, small enough to bite at
    random initialisation; sliding window). Those the installed transformers has."""
    out = {}
    try:
        from transformers import GptOssConfig

        out["gpt_oss"] = GptOssConfig(
            vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=24,
            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
            attention_dropout=0.0)
    except ImportError:
        pass
    try:
        from transformers import Gemma2Config

        out["gemma2"] = Gemma2Config(
            vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=24,
            attn_logit_softcapping=2.0, query_pre_attn_scalar=64, max_position_embeddings=512,
            attention_dropout=0.0)
    except ImportError:
        pass
    return out


SCORED = list(scored_configs())


def models(name, device, dtype, impl="compilemask"):
    """(the model under `impl` in `dtype`, its reference attention in `dtype`, the reference
    in float64), one set of random weights; the reference is sdpa, or eager for the models
    of scored_configs (sinks drawn with standard deviation 2, so that they matter)."""
    from transformers import AutoModelForCausalLM

    scored = scored_configs()
    cfg = scored[name] if name in scored else configs()[name]
    ref_impl = "eager" if name in scored else "sdpa"
    extra = {"experts_implementation": "eager"} if name == "gpt_oss" else {}
    torch.manual_seed(0)
    weights = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), **extra).state_dict()
    for n in weights:
        if n.endswith(".sinks"):
            weights[n] = torch.randn_like(weights[n]) * 2
    out = []
    for impl_, dt in ((impl, dtype), (ref_impl, dtype), (ref_impl, torch.float64)):
        m = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl_,
                                             **extra)
        assert m.config._attn_implementation == impl_
        m.load_state_dict(weights)
        out.append(m.to(device=device, dtype=dt).eval())
    return out


def ran(name=cmt.NAME):
    """Whether the backend `name` planned anything since the last call (so a comparison
    compared it, not sdpa with itself)."""
    cache = cmt._BACKENDS[name].cache
    planned = bool(cache)
    cache.clear()
    return planned


def err(a, ref):
    """Max absolute error relative to the reference's largest magnitude (at least 1)."""
    return (a.double() - ref.double()).abs().max().item() / max(1.0, ref.abs().max().item())


def within_rule(got, same_dtype_sdpa, ref, dtype, what):
    """docs/design.md: within twice the error of PyTorch's own attention in the same dtype,
    plus the dtype's absolute term."""
    e, e_sdpa = err(got, ref), err(same_dtype_sdpa, ref)
    assert not torch.isnan(got).any(), what
    assert e <= 2 * e_sdpa + ABS[dtype], (what, e, e_sdpa)


def tokens(device, b, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, n), generator=g).to(device)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("name", CONFIGS + SCORED)
def test_logits_loss_and_gradients_match_sdpa(name, device, dtype):
    """Logits, loss and every parameter's gradient (the sinks' included) against the
    reference attention (sdpa; eager for the models with score terms)."""
    ours, sdpa, ref = models(name, device, dtype)
    ids = tokens(device, 2, 61)
    results = []
    for m in (ours, sdpa, ref):
        m.zero_grad()
        out = m(ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
        results.append((out.logits.detach(), out.loss.detach(), grads))
    assert ran()
    (lo, so, go), (ls, ss, gs), (lr, sr, gr) = results
    within_rule(lo, ls, lr, dtype, "logits")
    within_rule(so.reshape(1), ss.reshape(1), sr.reshape(1), dtype, "loss")
    for n in gr:
        within_rule(go[n], gs[n], gr[n], dtype, f"grad {n}")


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("name", CONFIGS + SCORED)
def test_greedy_generation_matches_sdpa(name, device, dtype):
    ours, sdpa, ref = models(name, device, dtype)
    prompt = tokens(device, 1, 37, seed=2)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    a = ours.generate(prompt, **kw)[0].tolist()
    assert ran()
    b = sdpa.generate(prompt, **kw)[0].tolist()
    if a != b and dtype != torch.float32:
        # In bfloat16 two kernels may break a near-tie differently, and nothing else may
        # differ: at the first difference the two tokens' float64 logits are within
        # bfloat16's error of each other (relative 2e-2 of the largest logit).
        i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.no_grad():
            logits = ref(torch.tensor([b[:i]], device=device)).logits[0, -1]
        gap = (logits[b[i]] - logits[a[i]]).abs().item()
        assert gap <= 2e-2 * max(1.0, logits.abs().max().item()), (i, gap, a, b)
    else:
        assert a == b


DOCS = [17, 30, 13, 1]


def packed_inputs(device):
    ids = tokens(device, 1, sum(DOCS), seed=3)
    pos = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0).to(device)
    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    return ids, pos, cu


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("name", CONFIGS)
def test_packed_documents_equal_each_document_alone(name, how, device, dtype):
    ours, sdpa, ref = models(name, device, dtype)
    ids, pos, cu = packed_inputs(device)
    extra = {} if how == "position_ids" else dict(
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(DOCS), max_length_k=max(DOCS))
    with torch.no_grad():
        got = ours(ids, position_ids=pos, **extra).logits[0]
        assert any(k[0] == "packed" for k in cmt._BACKENDS[cmt.NAME].cache) and ran()
        alone = [[], []]
        for i, m in enumerate((sdpa, ref)):
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                alone[i].append(m(ids[:, a:b]).logits[0])
    within_rule(got, torch.cat(alone[0]), torch.cat(alone[1]), dtype, "packed logits")


# Left padding; and right padding in which no row reaches the batch's length (a batch padded
# to a multiple), whose rows stay where they are (a static cache's alignment once moved them
# up by the common padding).
PADDING = {"left": [(1, slice(0, 9)), (2, slice(0, 25))],
           "right": [(0, slice(33, None)), (1, slice(21, None)), (2, slice(38, None))]}


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("side", PADDING)
@pytest.mark.parametrize("name", CONFIGS)
def test_padded_batch_matches_sdpa(name, side, device, dtype):
    ours, sdpa, ref = models(name, device, dtype)
    ids = tokens(device, 3, 40, seed=4)
    mask = torch.ones_like(ids)
    for row, cols in PADDING[side]:
        mask[row, cols] = 0
    with torch.no_grad():
        out = [m(ids, attention_mask=mask).logits for m in (ours, sdpa, ref)]
    assert ran()
    valid = mask.bool()
    within_rule(out[0][valid], out[1][valid], out[2][valid], dtype, f"{side}-padded logits")


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("name", CONFIGS)
def test_a_static_cache_matches_sdpa(name, device, dtype):
    # A static cache holds slots for max_cache_len keys, of which a step has written only
    # those up to its last position: the rest are no row's keys, and the causal rows end at
    # the last written slot (they were aligned at the cache's end, and saw the empty slots).
    from transformers import StaticCache

    ours, sdpa, ref = models(name, device, dtype)
    ids = tokens(device, 2, 30, seed=5)
    with torch.no_grad():
        out = [m(ids, past_key_values=StaticCache(config=m.config, max_cache_len=64),
                 use_cache=True).logits for m in (ours, sdpa, ref)]
    assert ran()
    within_rule(out[0], out[1], out[2], dtype, "static-cache logits")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    a, b = ours.generate(ids, **kw), sdpa.generate(ids, **kw)
    if dtype == torch.float32:
        assert torch.equal(a, b)


def dense_reference(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                    **kwargs):
    """A float64 masked softmax with the plan's dense mask: the reference attention for a
    user program, in transformers' attention-function form."""
    q_len, kv_len = query.shape[2], key.shape[2]
    plan = CHUNKED.plan(q_len, kv_len, chunk=8)
    mask = plan.to_dense(format="torch").to(query.device)
    rep = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(rep, dim=1)
    v = value.double().repeat_interleave(rep, dim=1)
    s = (query.double() @ k.transpose(-1, -2)) * (scaling or 1 / math.sqrt(query.shape[-1]))
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    return (p @ v).to(query.dtype).transpose(1, 2).contiguous(), None


CHUNKED = cm.builtin("chunked_causal")


@pytest.mark.parametrize("device,dtype", TARGETS)
def test_a_user_program_in_every_layer(device, dtype):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = cmt.register("compilemask_chunked", CHUNKED, params={"chunk": 8})
    AttentionInterface.register("dense_reference", dense_reference)
    AttentionMaskInterface.register("dense_reference", cmt.mask_function)
    ours, _, _ = models("llama", device, dtype, impl=name)
    ref, _, _ = models("llama", device, torch.float64, impl="dense_reference")
    ids = tokens(device, 2, 45, seed=5)
    with torch.no_grad():
        got = ours(ids).logits
        want = ref(ids).logits
    assert ran(name)
    # Chunks of 8: a token sees only its own chunk, unlike causal attention.
    assert err(got, want) <= {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype], err(got, want)


def test_unsupported_features_are_named():
    ours, _, _ = models("llama", "cpu", torch.float32)
    layer = ours.model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 64)
    k = torch.zeros(1, 2, 3, 64)
    with pytest.raises(NotImplementedError, match="dropout"):
        cmt.attention_forward(layer, q, k, k, None, dropout=0.1)
    for cap in (-1.0, 0, float("nan"), float("inf"), True, "2", 1e-40, 1e39, torch.ones(2)):
        with pytest.raises(ValueError, match="expected a real number above 0 within float32"):
            cmt.attention_forward(layer, q, k, k, None, softcap=cap)
    # A registered program says its own score terms: what the model passes must be there.
    cmt.register("compilemask_chunks_test", "mask = k / 8 == q / 8;")
    with pytest.raises(NotImplementedError, match="passes sinks \\(s_aux\\), but the program of "
                       "backend 'compilemask_chunks_test' has no sink"):
        cmt.attention_forward(layer, q, k, k, None, s_aux=torch.zeros(4),
                              _backend="compilemask_chunks_test")
    with pytest.raises(NotImplementedError, match="softcap = 30.0, but the program of backend "
                       "'compilemask_chunks_test' has no softcap"):
        cmt.attention_forward(layer, q, k, k, None, softcap=30.0,
                              _backend="compilemask_chunks_test")
    holes = torch.tensor([[1, 0, 1]])
    with pytest.raises(ValueError, match="not one run"):
        cmt.attention_forward(layer, q, k, k, holes)


def test_softcap_as_numpy_or_tensor_scalar():
    """A cap given as a NumPy or one-element tensor scalar is the same cap as the float."""
    np = pytest.importorskip("numpy")
    ours, _, _ = models("llama", "cpu", torch.float32)
    layer = ours.model.layers[0].self_attn
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 9, 64, generator=g) * 3, torch.randn(1, 2, 9, 64, generator=g) * 3
    want, _ = cmt.attention_forward(layer, q, k, k, None, softcap=2.0)
    for cap in (np.float32(2.0), np.float64(2.0), torch.tensor(2.0), 2):
        got, _ = cmt.attention_forward(layer, q, k, k, None, softcap=cap)
        assert torch.equal(got, want), cap


@pytest.mark.parametrize("name", SCORED)
def test_a_registered_program_with_the_models_score_terms(name):
    """A registered program that writes the model's terms (gpt-oss's sinks read from the
    tensor its `sink` names, Gemma 2's cap) gives what the model's own masks give: its plan
    is bound per query head although its mask reads no `h`."""
    cfg = scored_configs()[name]
    window = cfg.sliding_window
    source = ("tensor s: [num_heads];\nsink = s[h];\n" if name == "gpt_oss" else
              f"score = softcap(score, {float(cfg.attn_logit_softcapping)!r});\n")
    # The causal window of the model's sliding layers (keys (p - w, p]).
    cmt.register("compilemask_scored_test", "let p = q + kv_len - q_len;\n"
                 f"mask = k <= p & k > p - {window};\n" + source)
    ours, _, _ = models(name, "cpu", torch.float64)
    layer = ours.model.layers[0].self_attn
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 40, 64, dtype=torch.float64, generator=g) * 3
    k = torch.randn(2, 2, 40, 64, dtype=torch.float64, generator=g) * 3
    extra = {"s_aux": layer.sinks} if name == "gpt_oss" else {"softcap": cfg.attn_logit_softcapping}
    with torch.no_grad():
        want, _ = cmt.attention_forward(layer, q, k, k, None, is_causal=True,
                                        sliding_window=window, **extra)
        got, _ = cmt.attention_forward(layer, q, k, k, None, is_causal=True,
                                       _backend="compilemask_scored_test", **extra)
    assert (got - want).abs().max().item() <= 1e-12


def test_register_refuses_names_and_parameters_it_cannot_honour():
    """transformers' own implementations are never replaced, a name is non-empty, and a
    parameter the program does not declare fails at register, not at the first forward."""
    for name in ("sdpa", "eager", "flash_attention_2", "flex_attention"):
        with pytest.raises(ValueError, match="one of transformers' own attention"):
            cmt.register(name, "mask = k <= q;")
    for name in ("", " padded", "owner/repo"):
        with pytest.raises(ValueError, match="expected a non-empty name"):
            cmt.register(name, "mask = k <= q;")
    with pytest.raises(TypeError, match="name must be a str"):
        cmt.register(3, "mask = k <= q;")
    with pytest.raises(cm.PlanError, match="unknown parameter `chunkz`"):
        cmt.register("compilemask_typo_test", cm.builtin("chunked_causal"), params={"chunkz": 8})
    with pytest.raises(ValueError, match="params are given without a program"):
        cmt.register("compilemask_typo_test", params={"chunk": 8})
    # Registering one of ours again replaces it.
    assert cmt.register("compilemask_twice_test", "mask = k <= q;") == "compilemask_twice_test"
    assert cmt.register("compilemask_twice_test", "mask = k < q;") == "compilemask_twice_test"
