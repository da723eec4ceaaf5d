"""The drafter: RoPE of every type the targets use, its shape per target family, cached = TTT."""

import pytest
import torch
from helpers.model import fp_tolerance

from draftsmith.core.export.formats import drafter_config_from_export, export_config
from draftsmith.core.model.drafter import (
    TTTKV,
    CacheKV,
    DrafterConfig,
    Eagle3Drafter,
    Rotary,
    derived_shape,
    param_count,
    split_rope,
    ttt_attention,
    ttt_attention_reference,
    ttt_mask,
    ttt_prefix_mask,
)

FP32_ULPS = 8 * torch.finfo(torch.float32).eps
D = 16  # head dim of the small drafters
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    # gpt-oss-like: attention factor from the scale factor (0.1 ln 32 + 1 = 1.35)
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 16,
    },
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(D // 2)],
        "long_factor": [2.0 + 0.5 * i for i in range(D // 2)],
        "original_max_position_embeddings": 16,
    },
}


def small_cfg(rope: dict, **over) -> DrafterConfig:
    theta, scaling = split_rope(rope)
    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=D,
        intermediate_size=48,
        rms_norm_eps=1e-6,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=256,
        target_hidden_size=24,
        target_vocab_size=50,
        draft_vocab_size=20,
        kind="eagle3",
        num_aux=3,
    )
    return DrafterConfig(**{**base, **over})


@pytest.mark.parametrize("kind", list(ROPES))
def test_rotary_is_transformers_rotary(kind):
    """cos/sin equal transformers' LlamaRotaryEmbedding for the same rope_parameters (dynamic: at the
    length vLLM precomputes, max positions x factor)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = small_cfg(ROPES[kind])
    hf = LlamaRotaryEmbedding(
        LlamaConfig(
            hidden_size=64,
            num_attention_heads=4,
            head_dim=D,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters=dict(ROPES[kind]),
        )
    )
    end = 512 if kind == "dynamic" else 200  # dynamic: HF recomputes for the longest position seen
    positions = torch.arange(end)[None]
    cos, sin = Rotary(cfg)(positions, torch.float32)  # [1, 1, T, d]
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), positions)  # [1, T, d]
    torch.testing.assert_close(cos[:, 0], hf_cos, rtol=0, atol=1e-6)  # fp32 cos of the same angles
    torch.testing.assert_close(sin[:, 0], hf_sin, rtol=0, atol=1e-6)
    default = Rotary(small_cfg(ROPES["default"]))
    if kind != "default":
        assert not torch.equal(Rotary(cfg).inv_freq, default.inv_freq) or Rotary(cfg).scaling != 1.0


def test_yarn_attention_factor():
    rot = Rotary(small_cfg(ROPES["yarn"]))
    assert rot.scaling == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1.0)


@pytest.mark.parametrize("kind", list(ROPES))
def test_cached_inference_equals_ttt(kind):
    """Step 0 over a sequence and step 1 at every position (TTT) equal a cached drafter fed the same
    tokens one by one and then its own hidden state at the next position. fp64 weights; TTT's softmax
    runs in fp32 as in training, so the paths agree to fp32 rounding (eps 1.2e-7) times a few ulps."""
    torch.manual_seed(0)
    cfg = small_cfg(ROPES[kind])
    d = Eagle3Drafter(cfg).double().eval()
    T = 40  # crosses original_max_position_embeddings (16) of the scaled types
    embeds = torch.randn(1, T + 1, cfg.hidden_size, dtype=torch.float64)
    fused = d.fuse(torch.randn(1, T, cfg.num_aux * cfg.target_hidden_size, dtype=torch.float64))
    positions = torch.arange(T)[None]
    with torch.no_grad():
        kv = TTTKV()
        logits0, h0 = d(embeds[:, :T], fused, positions, kv)
        logits1, _ = d(embeds[:, 1 : T + 1], h0, positions + 1, kv)
        for t in (0, 7, 15, 16, 39):
            cache = CacheKV()
            for i in range(t + 1):  # prefill one token at a time
                lc, hc = d(embeds[:, i : i + 1], fused[:, i : i + 1], positions[:, i : i + 1], cache)
            torch.testing.assert_close(lc[:, 0], logits0[:, t], rtol=FP32_ULPS, atol=1e-9)
            l1, _ = d(embeds[:, t + 1 : t + 2], hc, torch.tensor([[t + 1]]), cache)
            torch.testing.assert_close(l1[:, 0], logits1[:, t], rtol=FP32_ULPS, atol=1e-9)


def test_ttt_prefix_mask_lags_by_the_step():
    assert ttt_prefix_mask(4, 0).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert ttt_prefix_mask(4, 2).int().tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]


def test_ttt_mask_is_the_prefix_then_one_diagonal_per_later_step():
    assert ttt_mask(3, 2, lag=1).int().tolist() == [
        [0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ]


def ttt_inputs(steps: int, nkv: int, dtype: torch.dtype, T: int = 48) -> tuple:
    """q [2, 4, T, D] and `steps` keys [2, nkv, T, D] then as many values (GQA where nkv < 4)."""
    gen = torch.Generator().manual_seed(0)  # the same values in every dtype, rounded to it

    def draw(heads: int) -> torch.Tensor:
        return torch.randn(2, heads, T, D, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    q = draw(4)
    return q, [draw(nkv) for _ in range(steps)], [draw(nkv) for _ in range(steps)]


def attention_and_grads(fn, q, keys, values, lag: int) -> list[torch.Tensor]:
    """The output and the gradient of a fixed random projection of it w.r.t. q, every key and value."""
    out = fn(q, keys, values, lag)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), [q, *keys, *values])
    return [out.detach(), *grads]


@pytest.mark.parametrize(("steps", "lag", "nkv"), [(1, 0, 4), (3, 0, 4), (3, 0, 2), (3, 2, 4), (2, 1, 2)])
def test_fused_ttt_attention_equals_the_materialised_one(steps, lag, nkv):
    """fp32: output and gradients of the SDPA form equal the materialised scores' (the implementation
    before it) within fp32 rounding of two matmuls over T keys and a softmax, in the forward and twice
    that depth backward."""
    inputs = ttt_inputs(steps, nkv, torch.float32)
    fused = attention_and_grads(ttt_attention, *inputs, lag)
    reference = attention_and_grads(ttt_attention_reference, *inputs, lag)
    T = inputs[0].shape[2]
    for i, (a, b) in enumerate(zip(fused, reference, strict=True)):
        depth = 2 if i == 0 else 4
        torch.testing.assert_close(a, b, **fp_tolerance(torch.float32, depth, T, scale=b.abs().max()))


@pytest.mark.parametrize(("steps", "lag"), [(3, 0), (3, 2)])
def test_fused_ttt_attention_in_bf16_stays_within_bf16_rounding(steps, lag):
    """bf16 (as autocast trains on GPUs and AMX CPUs): the fused output is as close to the exact (fp64)
    attention as bf16 rounding allows, and no further from it than the materialised one (measured here:
    0.010 vs 0.018 at most, on values up to ~5)."""
    exact = attention_and_grads(ttt_attention_reference, *ttt_inputs(steps, 2, torch.float64), lag)[0]
    tol = fp_tolerance(torch.bfloat16, 2, 48, scale=exact.abs().max())
    errors = []
    for fn in (ttt_attention, ttt_attention_reference):
        out = attention_and_grads(fn, *ttt_inputs(steps, 2, torch.bfloat16), lag)[0].double()
        torch.testing.assert_close(out, exact, **tol)
        errors.append(float((out - exact).abs().max()))
    assert errors[0] <= 2 * errors[1], errors


def test_lagged_ttt_attention_hides_the_recent_prefix():
    """Step 1 with lag 1: position 0 sees no step-0 key, only its own step-1 key, so its output is that
    value exactly; later positions see step-0 keys < t and differ from the inference view (lag 0)."""
    torch.manual_seed(0)
    B, nh, T, d = 1, 2, 5, 4
    q = torch.randn(B, nh, T, d, dtype=torch.float64)
    keys = [torch.randn(B, nh, T, d, dtype=torch.float64) for _ in range(2)]
    values = [torch.randn(B, nh, T, d, dtype=torch.float64) for _ in range(2)]
    lagged = ttt_attention(q, keys, values, lag=1)
    torch.testing.assert_close(lagged[:, :, 0], values[1][:, :, 0], rtol=0, atol=1e-12)
    accepted = ttt_attention(q, keys, values)
    assert (lagged[:, :, 1:] - accepted[:, :, 1:]).abs().min() > 0
    # by hand at t = 3: scores over step-0 keys 0..2 and the step-1 key at 3
    k = torch.cat([keys[0][:, :, :3], keys[1][:, :, 3:4]], dim=2)
    v = torch.cat([values[0][:, :, :3], values[1][:, :, 3:4]], dim=2)
    p = torch.softmax((q[:, :, 3:4] @ k.transpose(-1, -2)) / d**0.5, dim=-1)
    torch.testing.assert_close(lagged[:, :, 3:4], p @ v, rtol=FP32_ULPS, atol=1e-12)


def test_ttt_kv_lags_only_when_asked():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 6, 4)
    steps = [(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)) for _ in range(3)]
    plain, lagged = TTTKV(), TTTKV(prefix_lag=True)
    for j, (k, v) in enumerate(steps):
        a, b = plain.attend(q, k, v), lagged.attend(q, k, v)
        torch.testing.assert_close(b, ttt_attention(q, lagged.keys, lagged.values, lag=j))
        assert torch.equal(a, b) == (j == 0)  # step 0 is the causal pass either way


def test_ttt_kv_shares_one_mask_across_steps():
    """With the step count known, every step attends through a view of one additive mask, as it would
    through its own boolean one."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 6, 4)
    steps = [(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)) for _ in range(3)]
    shared, plain = TTTKV(steps=3), TTTKV()
    for k, v in steps:
        torch.testing.assert_close(shared.attend(q, k, v), plain.attend(q, k, v))
    assert shared.bias.shape == (6, 18) and shared.bias.dtype == q.dtype


def test_ttt_mask_rows_are_aligned_for_cuda_sdpa_and_the_loss_is_unchanged(monkeypatch):
    """The shared TTT mask (steps x T columns: 3 x 12 = 36) lies in rows of 40 elements, a multiple of 8,
    so CUDA's memory-efficient SDPA takes it as it is instead of copying it padded; every step's view
    keeps that stride, and the loss and gradients equal those through a contiguous mask bit for bit."""
    from helpers.model import make_drafter
    from helpers.training import objective

    import draftsmith.core.model.drafter as drafter_module
    from draftsmith.core.data.loader import Batch
    from draftsmith.core.training.objective import ttt_loss

    kv = TTTKV(steps=3)
    kv.ensure_bias(12, torch.float32, torch.device("cpu"))
    assert kv.bias.shape == (12, 36) and kv.bias.stride(-2) % 8 == 0 and kv.bias[:, :24].stride(-2) == 40
    assert torch.equal(kv.bias.isfinite(), ttt_mask(12, 3))

    model = make_drafter(seed=3)
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    B, T = 2, 12
    ids = torch.randint(0, cfg.target_vocab_size, (B, T), generator=g)
    lengths = torch.tensor([T, T - 3])
    aux = torch.randn(B, T, cfg.num_aux * cfg.target_hidden_size, generator=g)
    final = torch.randn(B, T, cfg.target_hidden_size, generator=g)
    embed = torch.randn(cfg.target_vocab_size, cfg.hidden_size, generator=g)
    teacher = torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size, generator=g)
    batch = Batch(ids, torch.arange(T)[None] < lengths[:, None], lengths, aux, final)

    def loss_and_grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss = ttt_loss(model, embed, teacher, batch, objective(3))[0]
        loss.backward()
        return [loss.detach(), *(p.grad.clone() for p in model.parameters())]

    aligned = loss_and_grads()
    monkeypatch.setattr(drafter_module, "MASK_ALIGN", 1)  # the contiguous [T, steps * T] mask of before
    contiguous = loss_and_grads()
    assert all(torch.equal(a, b) for a, b in zip(aligned, contiguous, strict=True))


def test_rope_changes_the_drafter():
    """Same weights, llama3 vs plain RoPE: logits differ past the original context (the test above
    would pass with RoPE ignored altogether otherwise)."""
    torch.manual_seed(0)
    plain = Eagle3Drafter(small_cfg(ROPES["default"], rope_theta=500000.0)).double().eval()
    for w in plain.midlayer.self_attn.parameters():  # scores far from uniform: RoPE shows
        torch.nn.init.normal_(w, std=0.5)
    scaled = Eagle3Drafter(small_cfg(ROPES["llama3"])).double().eval()
    scaled.load_state_dict(plain.state_dict())
    x = torch.randn(1, 40, 32, dtype=torch.float64)
    pos = torch.arange(40)[None]
    with torch.no_grad():
        a = plain(x, x, pos, TTTKV())[0]
        b = scaled(x, x, pos, TTTKV())[0]
    assert (a[:, 16:] - b[:, 16:]).abs().max() > 1e-2


@pytest.mark.parametrize("kind", list(ROPES))
def test_export_keeps_the_rope(kind):
    cfg = small_cfg(ROPES[kind])
    config = export_config(cfg, [1, 2, 3], "target")
    assert config["rope_parameters"] == {**ROPES[kind], "rope_theta": cfg.rope_theta}
    assert drafter_config_from_export(config, engine_fields=True) == cfg
    # an export written by a transformers-4 tool: rope_theta + rope_scaling only
    legacy = {k: v for k, v in config.items() if k not in ("rope_parameters", "draftsmith")}
    assert drafter_config_from_export(legacy, engine_fields=True) == cfg


def test_unknown_rope_type_is_refused():
    with pytest.raises(ValueError, match="rope_type 'wavy'"):
        Rotary(small_cfg({"rope_type": "wavy", "rope_theta": 1.0}))


# ------------------------------------------------------------------------------ shapes per family


def llama3_8b():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={**ROPES["llama3"], "original_max_position_embeddings": 8192},
    )


def qwen3_235b():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        num_hidden_layers=94,
        num_experts=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


KIMI_TEXT = dict(
    model_type="deepseek_v3",
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=64,
    num_key_value_heads=64,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    num_hidden_layers=61,
    vocab_size=163840,
    max_position_embeddings=262144,
    rms_norm_eps=1e-5,
    rope_scaling={
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    rope_theta=50000.0,
)


def kimi_k25():
    """Kimi-K2.5's wrapper config as transformers sees it without the remote code."""
    from transformers import PretrainedConfig

    return PretrainedConfig(architectures=["KimiK25ForConditionalGeneration"], text_config=dict(KIMI_TEXT))


def test_llama_and_qwen_drafters_are_one_target_layer():
    cfg = DrafterConfig.from_target(llama3_8b(), 32000)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        4096,
        32,
        8,
        128,
    )
    assert cfg.intermediate_size == 14336
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
    q = DrafterConfig.from_target(qwen3_235b(), 32000)
    # Qwen3's heads are wider than hidden / heads: the drafter keeps head_dim 128 and 64 x 4 heads
    assert (q.num_attention_heads, q.num_key_value_heads, q.head_dim, q.intermediate_size) == (
        64,
        4,
        128,
        12288,
    )
    assert q.rope_scaling is None and q.rope_theta == 1e6


def test_mla_drafter_has_the_published_kimi_shape():
    """Kimi-K2.5's published EAGLE-3 drafter: hidden 7168, 64 heads x 128, 64 kv heads, MLP 12288 —
    not the RoPE part of MLA's heads (64) nor the dense MLP width (18432)."""
    cfg = DrafterConfig.from_target(kimi_k25(), 32000)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        7168,
        64,
        64,
        128,
    )
    assert cfg.intermediate_size == 12288
    assert (cfg.target_vocab_size, cfg.max_position_embeddings) == (163840, 262144)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 64.0
    # fc 3*7168^2 + attention 2*7168*128*(64+128) + 8192*7168 + MLP 3*7168*12288 + norms + lm_head
    assert param_count(cfg) == 154140672 + 352321536 + 58720256 + 264241152 + 4 * 7168 + 229376000


def test_explicit_shape_wins_and_is_checked():
    shape = {"intermediate_size": 8192, "rope": {"rope_type": "default", "rope_theta": 1e6}}
    cfg = DrafterConfig.from_target(kimi_k25(), 32000, shape={**shape, "head_dim": None})
    assert (cfg.intermediate_size, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) == (8192, 128, 1e6, None)
    with pytest.raises(ValueError, match="hidden_size=1024 must equal the target's hidden_size 7168"):
        DrafterConfig.from_target(kimi_k25(), 32000, shape={"hidden_size": 1024})
    with pytest.raises(ValueError, match="unknown keys \\['heads'\\]"):
        DrafterConfig.from_target(kimi_k25(), 32000, shape={"heads": 8})
    with pytest.raises(ValueError, match="not a multiple"):
        DrafterConfig.from_target(llama3_8b(), 32000, shape={"num_key_value_heads": 5})


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_param_count_matches_the_module(family):
    """Small configs of each family: param_count = the built drafter's parameters."""
    from transformers import AutoConfig

    common = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, vocab_size=300)
    extra = {
        "llama": dict(num_key_value_heads=2),
        "qwen3": dict(num_key_value_heads=2, head_dim=96),
        "qwen3_moe": dict(num_key_value_heads=2, num_experts=8, moe_intermediate_size=64),
        "deepseek_v3": dict(kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64),
    }[family]
    text = AutoConfig.for_model(family, **common, **extra)
    cfg = DrafterConfig.from_target(text, 40)
    assert derived_shape(text)["head_dim"] == {"qwen3": 96, "deepseek_v3": 128}.get(family, 64)
    model = Eagle3Drafter(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_target_only_rope_keys_are_dropped():
    """Qwen3-VL's multimodal RoPE sections and a partial rotary factor belong to the target's layers;
    the drafter rotates its whole head by token position (vLLM would build an M-RoPE drafter else)."""
    from transformers import Qwen3Config

    text = Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
                         "mrope_interleaved": True, "partial_rotary_factor": 0.5},
    )  # fmt: skip
    cfg = DrafterConfig.from_target(text, 10)
    assert (cfg.rope_theta, cfg.rope_scaling) == (5e6, None)
    assert Rotary(cfg).inv_freq.numel() == cfg.head_dim // 2
