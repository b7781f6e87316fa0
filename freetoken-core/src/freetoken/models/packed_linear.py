"""The dense part of a GGUF model kept on the device as the file's blocks.

:class:`PackedWeightPolicy` is :class:`~freetoken.models.layers.DeviceWeightPolicy` with
the block-format matrices left packed: every linear whose file format is Q4_K, Q5_K, Q6_K
or Q8_0 (attention q/k/v/o, the output head, dense MLPs, shared experts) is moved to the
device as its bytes and run by :class:`PackedLinear`; the token embedding's rows are
dequantized on the device as tokens need them (:class:`PackedEmbedding`); routers stay
float32 and float formats (F16/BF16/F32) are converted to the activation dtype, as the
dequantized policy does. For Qwen3-30B-A3B at Q4_K_M the dense part takes about 0.9 GiB
this way instead of 2.9 GiB in BF16: room for several more layers of experts on a small
card, where each GPU-resident expert layer saves far more CPU time per token than the
packed kernels cost.

How a :class:`PackedLinear` computes, by the number of tokens ``T`` of a call:

* ``T = 1`` with a backend's native GEMV (:class:`~freetoken.backends.contract.PackedGemv`)
  that serves the matrix's format and width: that kernel (one launch, capturable in graphs);
* ``T <= config.max_gemv_tokens`` (decode): the packed GEMV of
  :mod:`freetoken.kernels.packed_linear` (one launch, weights read once per token
  tile, no host synchronisation, capturable in graphs);
* larger ``T`` (prefill): chunks of rows dequantized into one scratch shared by all the
  policy's linears (at most :data:`SCRATCH_VALUES` values, allocated once at first use),
  each multiplied by ``torch.matmul``.

With ``prompt_copies`` (``--gpu-dense both``) every linear but the output head also keeps a
copy at the activation dtype, made at load: one token reads the blocks (the first two paths),
every call of several tokens (decode batches too: at 8 tokens the BF16 product decoded 40%
faster than the packed GEMV on an H100) is one ``torch.matmul`` over the copy; the memory of
both forms.

Where Triton does not run (not an NVIDIA GPU of compute capability >= 8.0), every call
takes the second path with the torch dequantization of :mod:`freetoken.loading.dequant`
(correct, slow: meant for checking, not serving).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F

from freetoken.loading.tensors import RawTensor, fmt_name
from freetoken.models.layers import DeviceWeightPolicy, Embedding, TorchLinear, _check_matrix

log = logging.getLogger(__name__)

#: ggml types kept packed on the device (Q8_0, Q4_K, Q5_K, Q6_K: the formats the packed
#: kernels decode)
PACKED_FORMATS = frozenset({8, 12, 13, 14})

#: Values of the prefill scratch (one chunk of dequantized rows): 32 Mi values, 64 MiB in BF16
SCRATCH_VALUES = 32 << 20


def packed_dense_impl(device: Any) -> tuple[str, str]:
    """(implementation, why) of packed linears on ``device``: ``triton`` where the packed
    expert kernels run (NVIDIA GPUs of compute capability >= 8.0 with triton), else ``torch``."""
    from freetoken.kernels import availability

    return availability.default_impl(device)


def chunk_rows(rows: int, cols: int) -> int:
    """Rows of a ``[rows, cols]`` packed linear dequantized at a time by its large-batch
    path (the prefill scratch holds ``chunk_rows(rows, cols) * cols`` values)."""
    return min(int(rows), max(1, SCRATCH_VALUES // int(cols)))


class PrefillScratch:
    """One buffer the large-batch path of every :class:`PackedLinear` of a policy
    dequantizes into (linears run one after another on one stream). Its size is the
    largest chunk of the linears registered before its first use; it is allocated once,
    so decode graphs that use it keep a valid address."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.values = 0
        self.buffer: Optional[torch.Tensor] = None

    def reserve(self, values: int) -> None:
        self.values = max(self.values, int(values))

    def get(self, rows: int, cols: int) -> torch.Tensor:
        n = rows * cols
        if self.buffer is None or self.buffer.numel() < n:
            if self.buffer is not None:
                log.warning("packed dense scratch grows from %d to %d values after first use", self.buffer.numel(), n)
            self.buffer = torch.empty(max(n, self.values), dtype=self.dtype, device=self.device)
        return self.buffer[:n].view(rows, cols)

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()


class PackedLinear:
    """``y = x @ W.T`` with ``W [out, in]`` on the device as the file's blocks."""

    packed = True

    def __init__(self, data: torch.Tensor, fmt: int, shape: tuple[int, int], scratch: PrefillScratch,
                 impl: str = "triton", config: Any = None, native: Any = None,
                 dtype: Optional[torch.dtype] = None, prompt_weight: Optional[torch.Tensor] = None) -> None:  # fmt: skip
        self.out_features, self.in_features = (int(s) for s in shape)
        #: ``[out, in]`` at the activation dtype for the calls the GEMVs do not take (prompts), or None
        self.prompt_weight = prompt_weight
        self.fmt = int(fmt)
        self.data = data.reshape(self.out_features, -1)  # [N, row_bytes] uint8
        self.nbytes = int(data.numel())
        self.impl = impl
        self.scratch = scratch
        self.matrix: Any = None
        self.config: Any = None  # one token
        self.batch_config: Any = None  # several
        if impl == "triton":
            from freetoken.kernels import packed_linear as plt

            self.matrix = plt.PackedMatrix.from_bytes(self.data.reshape(-1), self.fmt, self.out_features,
                                                      self.in_features)
            self.config = config or plt.config_for(self.out_features, data.device)
            # the device's tiles (NVIDIA: int8 dots) serve one token; batches of several run
            # the byte tiles, timed for them, unless a config is given
            self.batch_config = config or plt.config_for(self.out_features)
            self.config.validate()
            self.batch_config.validate()
        elif impl != "torch":
            raise ValueError(f"packed linear: impl must be 'triton' or 'torch', got {impl!r}")
        #: the backend's one-token GEMV (a :class:`~freetoken.backends.contract.PackedGemv`), when
        #: it serves this matrix with activations of ``dtype``
        self.native = native if native is not None and not native.refusal(self.fmt, self.in_features, dtype) \
            else None
        self.chunk_rows = chunk_rows(self.out_features, self.in_features)
        if prompt_weight is None:
            scratch.reserve(self.chunk_rows * self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        tokens = x2.shape[0]
        y = torch.empty((tokens, self.out_features), dtype=x.dtype, device=x.device)
        config = self.config if tokens == 1 else self.batch_config
        copy = self.prompt_weight is not None and self.prompt_weight.dtype == x2.dtype
        if tokens == 1 and self.native is not None and x2.data_ptr() % 16 == 0:
            self.native.gemv(x2, self.data, self.fmt, y)
        elif tokens and copy and (tokens > 1 or self.matrix is None):
            torch.matmul(x2, self.prompt_weight.t(), out=y)
        elif tokens and self.matrix is not None and tokens <= config.max_gemv_tokens:
            from freetoken.kernels import packed_linear as plt

            plt.gemv(x2, self.matrix, y, config)
        elif tokens:
            self._dequantized_matmul(x2, y)
        return y.reshape(*lead, self.out_features)

    def _dequantized_matmul(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y = x @ W.T`` a chunk of rows at a time, each dequantized into the scratch."""
        for r0 in range(0, self.out_features, self.chunk_rows):
            rows = min(self.chunk_rows, self.out_features - r0)
            w = self.dequantize(r0, rows, x.dtype)
            if rows == self.out_features:
                torch.matmul(x, w.t(), out=y)
            else:
                y[:, r0 : r0 + rows] = F.linear(x, w)

    def dequantize(self, first: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``first .. first + rows`` of ``W`` in ``dtype``, in the scratch (valid until the
        next call of any linear sharing it)."""
        w = self.scratch.get(rows, self.in_features)
        if w.dtype != dtype:
            w = torch.empty((rows, self.in_features), dtype=dtype, device=w.device)
        if self.matrix is not None:
            from freetoken.kernels import packed_linear as plt

            plt.dequantize_rows(self.matrix, w, first)
        else:
            from freetoken.loading.dequant import dequantize

            dequantize(self.data[first : first + rows], self.fmt, (rows, self.in_features), out=w)
        return w


def _byte_rows(raw: RawTensor) -> torch.Tensor:
    """The raw tensor's bytes in the file, one row of blocks per matrix row (host memory)."""
    data = raw.raw_torch()
    if data.dtype != torch.uint8:
        data = data.view(torch.uint8)
    return data.reshape(int(raw.shape[0]), -1)


class PackedEmbedding:
    """Token embedding over a packed table: the rows of a step's tokens are dequantized on
    ``device`` (one launch, only their blocks read, capturable in graphs). The table is on
    the device, or (``data`` in page-locked host memory, Triton kernels) read from the host
    over PCIe by the same kernel: a step's few rows cost microseconds, and the table's bytes
    stay free for other weights."""

    def __init__(self, raw: RawTensor, data: torch.Tensor, dtype: torch.dtype, impl: str = "triton",
                 device: Any = None) -> None:  # fmt: skip
        _check_matrix(raw)
        self.raw = raw
        self.device = torch.device(device) if device is not None else data.device
        self.dtype = dtype
        self.rows, self.cols = (int(s) for s in raw.shape)
        self.fmt = int(raw.fmt)
        self.data = data.reshape(self.rows, -1)
        self.nbytes = int(data.numel())
        self.matrix: Any = None
        if impl == "triton":
            from freetoken.kernels import packed_linear as plt

            self.matrix = plt.PackedMatrix.from_bytes(self.data.reshape(-1), self.fmt, self.rows, self.cols)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        out = torch.empty((flat.shape[0], self.cols), dtype=self.dtype, device=self.device)
        if self.matrix is not None:
            from freetoken.kernels import packed_linear as plt

            plt.gather_rows(flat.contiguous(), self.matrix, out)
        elif flat.shape[0]:
            from freetoken.loading.dequant import dequantize

            rows = self.data.index_select(0, flat.to(self.data.device, torch.int64))
            dequantize(rows, self.fmt, (flat.shape[0], self.cols), out=out)
        return out.reshape(*ids.shape, self.cols)


class PackedWeightPolicy(DeviceWeightPolicy):
    """Block-format dense weights kept packed on ``device`` (see the module docstring);
    everything else as :class:`DeviceWeightPolicy`. ``device_bytes`` counts what it
    placed: equal to the checkpoint's ``ModelShape.dense_file_bytes`` for a GGUF file."""

    def __init__(self, device: Any, dtype: torch.dtype, impl: Optional[str] = None, config: Any = None,
                 host_embedding: bool = False, gemv: Any = None, prompt_copies: bool = False) -> None:  # fmt: skip
        super().__init__(device, dtype)
        #: each packed linear but the output head also keeps a copy at the activation dtype for
        #: prompts (``--gpu-dense both``)
        self.prompt_copies = prompt_copies
        self.prompt_bytes = 0  # those copies
        self.impl = impl or packed_dense_impl(self.device)[0]
        #: the backend's one-token GEMV (:class:`~freetoken.backends.contract.PackedGemv`) or None
        self.gemv = gemv
        self.native_linears = 0  # linears it serves
        #: a packed embedding table stays in page-locked host memory (read by the Triton kernel)
        self.host_embedding = host_embedding and self.impl == "triton"
        self.host_bytes = 0
        if self.impl == "torch":
            log.warning("packed dense weights on %s run through torch dequantization (%s): slow",
                        self.device, packed_dense_impl(self.device)[1])
        self.config = config
        self.scratch = PrefillScratch(self.device, dtype)
        self.packed_bytes = 0  # block-format tensors, as in the file
        self.float_bytes = 0  # everything else, at the activation dtype (routers float32)
        self.formats: dict[str, int] = {}  # format name -> tensors kept packed
        self._embedding: Optional[tuple[tuple[Any, ...], Any]] = None  # (key, what the embedding holds)

    @staticmethod
    def _key(raw: RawTensor) -> tuple[Any, ...]:
        return (raw.source, raw.name, int(raw.fmt), tuple(raw.shape))

    def _packed_bytes(self, raw: RawTensor) -> torch.Tensor:
        """The raw tensor's bytes on the device (shared with the embedding of the same tensor)."""
        if self._embedding is not None and self._embedding[0] == self._key(raw):
            held = self._embedding[1]
            if isinstance(held, PackedEmbedding) and held.data.device == self.device:
                return held.data
        dev = _byte_rows(raw).to(self.device)
        self.packed_bytes += dev.numel()
        name = fmt_name(int(raw.fmt))
        self.formats[name] = self.formats.get(name, 0) + 1
        return dev

    def _float(self, raw: RawTensor, dtype: torch.dtype) -> torch.Tensor:
        t = raw.to_float(dtype).to(self.device)
        self.float_bytes += t.numel() * t.element_size()
        return t

    def tensor(self, raw: RawTensor) -> torch.Tensor:
        return self._float(raw, self.dtype)

    def linear(self, raw: RawTensor) -> Any:
        return self._linear(raw, self.prompt_copies)

    def output_head(self, raw: RawTensor) -> Any:
        return self._linear(raw, False)  # a few rows per request: the GEMVs', never a prompt's

    def _linear(self, raw: RawTensor, prompt_copy: bool) -> Any:
        _check_matrix(raw)
        if int(raw.fmt) in PACKED_FORMATS:
            copy = None
            if prompt_copy:
                copy = raw.to_float(self.dtype).to(self.device)
                self.prompt_bytes += copy.numel() * copy.element_size()
            lin = PackedLinear(self._packed_bytes(raw), int(raw.fmt), tuple(raw.shape), self.scratch, self.impl,
                               self.config, self.gemv, self.dtype, copy)  # fmt: skip
            self.native_linears += lin.native is not None
            return lin
        held = self._embedding[1] if self._embedding is not None and self._embedding[0] == self._key(raw) else None
        if isinstance(held, Embedding) and held.table is not None:
            return TorchLinear(held.table)  # a tied head over a float embedding table: one copy
        return TorchLinear(self._float(raw, self.dtype))

    def router(self, raw: RawTensor) -> Any:
        from freetoken.models.layers import RouterLinear

        _check_matrix(raw)
        return RouterLinear(self._float(raw, torch.float32))

    def stacked_linear(self, raws: list[RawTensor]) -> None:
        return None  # matrices of one format are concatenated by the caller; formats stay apart

    def embedding(self, raw: RawTensor) -> Any:
        if int(raw.fmt) in PACKED_FORMATS and self.host_embedding:
            emb: Any = PackedEmbedding(raw, self._host_table(raw), self.dtype, self.impl, self.device)
        elif int(raw.fmt) in PACKED_FORMATS:
            emb = PackedEmbedding(raw, self._packed_bytes(raw), self.dtype, self.impl)
        else:
            emb = Embedding(raw, self.device, self.dtype, keep_packed=False)
            assert emb.table is not None
            self.float_bytes += emb.table.numel() * emb.table.element_size()
        self._embedding = (self._key(raw), emb)
        return emb

    def _host_table(self, raw: RawTensor) -> torch.Tensor:
        """The raw table's bytes in page-locked host memory (a simulated GPU whose device is
        the host: its own memory)."""
        data = _byte_rows(raw)
        table = data.pin_memory() if self.device.type != "cpu" else data
        self.host_bytes += table.numel()
        return table

    @property
    def device_bytes(self) -> int:
        return self.packed_bytes + self.float_bytes + self.prompt_bytes

    def describe(self) -> dict[str, Any]:
        kept = ", ".join(f"{n} x{c}" for n, c in sorted(self.formats.items())) or "none"
        act = str(self.dtype).replace("torch.", "")
        one = (f"; one token through {self.native_linears} of them by the backend's {self.gemv.name} GEMV"
               if self.gemv is not None else "")
        copies = (f"; prompts through {act} copies of them ({self.prompt_bytes / 2**30:.2f} GiB)"
                  if self.prompt_copies else "")
        return {"dense": f"GGUF blocks kept on {self.device} ({kept}; {self.packed_bytes / 2**30:.2f} GiB), "
                         f"run by {self.impl} kernels{one}{copies}; other formats as {act} "
                         f"({self.float_bytes / 2**30:.2f} GiB)",
                "embedding": (f"packed table in page-locked host memory ({self.host_bytes / 2**30:.2f} GiB), its "
                              "rows read over PCIe and dequantized on the device per step" if self.host_bytes else
                              "packed rows dequantized on the device per step"),
                "dense_form": "both" if self.prompt_copies else "packed", "dense_device_bytes": self.device_bytes}
