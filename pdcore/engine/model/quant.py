"""W8A8 int8 linear layers: the compressed-tensors W8A8 layout (what `--quantization w8a8_int8`
serves; engine/model/quant_config.py reads it from config.json).

A checkpoint holds, for each decoder projection, `weight` int8 [out, in] and `weight_scale`
float [out, 1]: symmetric, one scale per output channel, W ~= weight * weight_scale. The weights
stay int8 in memory (a quarter of float32's bytes). At run time each row (token) of the input is
quantized on its own, symmetric: s_x = max|x| / 127, x_q = round(x / s_x) clamped to [-127, 127]
(what vLLM's and SGLang's dynamic per-token kernels compute), then

    y[m, n] = s_x[m] * s_w[n] * sum_k x_q[m, k] * w_q[n, k]   (+ bias)

with the sum an int8 x int8 -> int32 GEMM (exact) and the scales applied after, in float32.
On the CPU the GEMM is engine/native's (int8_gemm.h: AVX-512 VNNI where the CPU has it, else
AVX2; the weight packed once at load into its panels, which replace the int8 matrix), equal to
the bit to the torch path kept for where no native library serves (torch's `_int_mm`, oneDNN's
or the reference int8 kernels; measured slower on this project's CPUs at decode sizes).

`Int8Checkpoint` wraps the checkpoint's mapping so the model's ordinary loading code
(ColumnLinear.load / RowLinear.load in layers.py) receives each int8 weight with its scale
attached (`SCALE_ATTR`) and keeps it as an `Int8Weight` instead of a float matrix.

The checkpoint leaves the lm_head float (compressed-tensors' `ignore: ["lm_head"]`, as
llmcompressor writes it): on SmolLM2-135M its tied 49152 x 576 float32 matrix is half the bytes
a decode step reads. By default (PDCORE_W8A8_LM_HEAD=bf16) loader.bf16_lm_head rounds its weights
to bf16 (half the bytes; float32 activations); =float keeps it as stored; =bf16_dot (opt-in,
AVX-512 BF16) rounds its input to bf16 too for bf16 dot products with float32 logits
(loader.bf16_dot_lm_head: no step gain measured on Zen 5, docs/quantization.md). With
PDCORE_W8A8_LM_HEAD=int8, `int8_lm_head` quantizes it at load the way
the body is quantized (one symmetric scale per output channel with compressed-tensors' qparams;
activations per token at run time), so it runs through the same int8 GEMM at a quarter of the
bytes. Opt-in: on SmolLM2 it costs top-1 agreement with float32 (bench/quant_accuracy.py: 90.3%
-> 88.5% on the round-to-nearest W8A8 checkpoint; the per-token activation scale of the final
norm's output, whose largest values are ~40x its median, is the loss).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

SCALE_ATTR = "pd_weight_scale"  # set on an int8 weight handed out by Int8Checkpoint
QMAX = 127


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q int8 [M, K], s_x float32 [M, 1]): each row symmetric on its own absolute maximum; a
    row of zeros gets scale 1 (and all-zero x_q)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    xq = torch.round(xf / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return xq, scale


class Int8Weight:
    """One linear layer's int8 weight [N, K] (row n: output feature n) and its float32 scale [N];
    called on x [..., K] it returns x W^T in x's dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"an int8 weight must be an int8 matrix, got {q.dtype} {tuple(q.shape)}")
        scale = scale.reshape(-1).float().contiguous()
        if scale.numel() != q.shape[0]:
            raise ValueError(f"weight_scale holds {scale.numel()} values for {q.shape[0]} output "
                             "channels (W8A8 scales are per output channel)")
        self.scale = scale
        self.path = 0  # native.int8_path: 3 AMX, 2 VNNI, 1 AVX2; 0: torch._int_mm
        self.packed: torch.Tensor | None = None  # its panels, where it serves
        if q.device.type == "cpu":
            from pdcore.engine import native

            self.path = native.int8_path()
        if self.path:
            self.packed = torch.ops.pdcore_native.int8_pack(q.contiguous(), scale)
            self.q = torch.empty_strided(q.shape, (0, 0), dtype=torch.int8)  # shape only
        else:
            self.q = q.contiguous().clone()  # owned memory: not the checkpoint's mapped file
        self.qt = self.q.t()  # [K, N] view for _int_mm

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def matrix(self) -> torch.Tensor:
        """The int8 matrix [N, K] (from the panels where they hold it: references, checks)."""
        if self.packed is None:
            return self.q
        n, k = self.q.shape
        kp = (k + 3) // 4 * 4
        w = self.packed[:, : kp * 32].view(-1, kp // 4, 32, 4).permute(0, 2, 1, 3)
        return w.reshape(-1, kp)[:n, :k].contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is not None and x.device.type == "cpu":
            return torch.ops.pdcore_native.int8_linear(x, self.packed, self.q.shape[0], bias,
                                                       self.path)
        if self.packed is not None:
            raise RuntimeError("a W8A8 weight packed for the CPU's native GEMM got a "
                               f"{x.device.type} input")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, self.q.shape[0])
        xq, xs = quantize_rows(x2)
        acc = torch._int_mm(xq, self.qt)
        y = acc.float().mul_(xs).mul_(self.scale)
        if bias is not None:
            y.add_(bias.float())
        return y.to(x.dtype).view(*lead, self.q.shape[0])

    def dequantized(self) -> torch.Tensor:
        """W = w_q * s_w as float32 [N, K] (references and checks)."""
        return self.matrix().float() * self.scale[:, None]

    def tensors(self) -> list[torch.Tensor]:
        """What it holds (loader.weight_bytes counts them)."""
        return [self.q if self.packed is None else self.packed, self.scale]


def quantize_weight(w: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_q int8 [N, K], s_w float32 [N]): a float matrix quantized per output channel as
    compressed-tensors quantizes a W8A8 checkpoint's linear weights (its symmetric int8 qparams:
    s_w = max|w[n]| / 127.5, w_q = round(w / s_w) (half to even) clamped to [-128, 127]);
    `rows` at a time (a float copy of a slice, not of the whole matrix)."""
    q = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0], dtype=torch.float32)
    for a in range(0, w.shape[0], rows):
        part = w[a : a + rows].float()
        amax = part.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / 127.5, torch.ones_like(amax))
        q[a : a + rows] = torch.round(part / s[:, None]).clamp_(-128, 127).to(torch.int8)
        scale[a : a + rows] = s
    return q, scale


def int8_lm_head(model: torch.nn.Module) -> bool:
    """Replace a W8A8 model's float lm_head by an Int8Weight (`quantize_weight`; activations per
    token at run time, the body's int8 GEMM) as its `lm_head_packed`, which `layers.linear`
    routes to; the float matrix becomes an int8 stand-in of its shape (no bytes). False where the
    lm_head is already packed another way (GGUF blocks) or not a float matrix."""
    head = model.lm_head
    if (getattr(model, "lm_head_packed", None) is not None or head.dim() != 2
            or not head.dtype.is_floating_point or head.device.type != "cpu"):
        return False
    q, scale = quantize_weight(head.detach())
    model.lm_head_packed = Int8Weight(q, scale)
    model.lm_head = lm_head_stand_in(head)
    return True


def lm_head_stand_in(head: torch.Tensor) -> torch.nn.Parameter:
    """What stays of an lm_head matrix packed elsewhere: its shape, no bytes (zero strides).
    int8, like the body's stand-ins: a model.to(dtype) leaves it be (a float stand-in would be
    materialized at full size by a dtype conversion)."""
    return torch.nn.Parameter(torch.empty_strided(head.shape, (0, 0), dtype=torch.int8),
                              requires_grad=False)


def scale_of(weight: torch.Tensor) -> torch.Tensor:
    """The per-output-channel scale Int8Checkpoint attached to an int8 weight."""
    scale = getattr(weight, SCALE_ATTR, None)
    if scale is None:
        raise ValueError("an int8 weight without its weight_scale: the checkpoint is not in the "
                         "compressed-tensors W8A8 layout")
    return scale.reshape(-1)


class CheckpointView(Mapping[str, torch.Tensor]):
    """A checkpoint mapping read through a quantization format: names, length and page release
    are the wrapped mapping's; a subclass decides what `__getitem__` hands out."""

    def __init__(self, sd: Mapping[str, torch.Tensor]) -> None:
        self.sd = sd

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.sd[name]

    def __contains__(self, name: object) -> bool:
        return name in self.sd

    def __iter__(self) -> Iterator[str]:
        return iter(self.sd)

    def __len__(self) -> int:
        return len(self.sd)

    def release_pages(self) -> int:
        release = getattr(self.sd, "release_pages", None)
        return release() if release is not None else 0


class Int8Checkpoint(CheckpointView):
    """The checkpoint's tensors by name, each int8 `X.weight` handed out with its
    `X.weight_scale` attached; everything else as the wrapped mapping has it."""

    def __init__(self, sd: Mapping[str, torch.Tensor]) -> None:
        super().__init__(sd)
        self.int8_names: set[str] = set()  # int8 weights handed out (a check that all were used)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.sd[name]
        if t.dtype == torch.int8 and name.endswith(".weight"):
            scale_name = name[: -len("weight")] + "weight_scale"
            if scale_name not in self.sd:
                raise KeyError(scale_name)
            t = t.view(t.shape)  # a fresh tensor object to carry the attribute
            setattr(t, SCALE_ATTR, self.sd[scale_name])
            self.int8_names.add(name)
        return t

    def int8_weight_names(self) -> set[str]:
        return {n for n in self.sd if n.endswith(".weight") and
                n[: -len("weight")] + "weight_scale" in self.sd}


class Int8Experts:
    """A MoE layer's local experts in int8: per expert gate+up [2I, H] and down [H, I] as
    Int8Weights (per-output-channel scales, activations quantized per token at run time,
    engine/native's int8 GEMM where it serves). `run` computes one expert on its rows."""

    def __init__(self, w13: list[Int8Weight], w2: list[Int8Weight]) -> None:
        self.w13, self.w2 = w13, w2

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, then down, for expert `e` on rows x [n, H]."""
        gu = self.w13[e](x)
        inter = gu.shape[-1] // 2
        h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        return self.w2[e](h)

    def tensors(self) -> list[torch.Tensor]:
        return [t for w in (*self.w13, *self.w2)
                for t in (w.q if w.packed is None else w.packed, w.scale)]


def int8_experts(sd: Mapping[str, torch.Tensor], prefix: str, first_expert: int, n: int,
                 inter_first: int, inter: int) -> Int8Experts | None:
    """The experts first_expert..+n of the MoE block at `prefix` kept int8 (intermediate
    features inter_first..+inter: a TP share), where the checkpoint holds them per expert in
    int8 with their scales (msModelSlim's layout); None otherwise."""
    p0 = prefix + f"experts.{first_expert}.gate_proj.weight"
    if p0 not in sd or sd[p0].dtype != torch.int8:
        return None
    w13, w2 = [], []
    for e in range(first_expert, first_expert + n):
        p = prefix + f"experts.{e}."
        gate, up, down = (sd[p + f"{name}.weight"] for name in ("gate_proj", "up_proj",
                                                                 "down_proj"))
        if not gate.dtype == up.dtype == down.dtype == torch.int8:
            raise ValueError(f"{p}: an expert with int8 and float projections")
        rows = slice(inter_first, inter_first + inter)
        w13.append(Int8Weight(torch.cat([gate[rows], up[rows]]),
                              torch.cat([scale_of(gate)[rows], scale_of(up)[rows]])))
        w2.append(Int8Weight(down[:, rows], scale_of(down)))
    return Int8Experts(w13, w2)
