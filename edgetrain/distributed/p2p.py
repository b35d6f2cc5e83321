"""Point-to-point tensors between neighbouring pipeline workers on torch.distributed: non-blocking sends
to the next rank (a bounded queue of outstanding sends), blocking receives from the previous one. A
message is a fixed-size header (dtype, shape) and the payload, so the receiver needs no prior shape."""
from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from edgetrain.registry import EdgetrainError

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3, torch.int64: 4,
               torch.int32: 5}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
HEADER_LEN = 10  # dtype code, ndim, up to 8 dims


class Channel:
    """Tensors to the next worker (non-blocking, a bounded queue of outstanding sends) and from the
    previous one (blocking). A message is a fixed-size header (dtype, shape) and the payload."""

    def __init__(self, rank: int, world: int, device: torch.device, max_pending: int) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.pending: deque[tuple[Any, torch.Tensor]] = deque()
        self.max_pending = max_pending
        self.wait_seconds = 0.0  # time blocked receiving or on the send queue: the pipeline's bubbles

    def send(self, tensor: torch.Tensor) -> None:
        if tensor.dim() > HEADER_LEN - 2 or tensor.dtype not in DTYPE_CODES:
            raise EdgetrainError(f"scpl_pipeline cannot send a {tensor.dtype} tensor of shape {tuple(tensor.shape)}")
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0], header[1] = DTYPE_CODES[tensor.dtype], tensor.dim()
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        for payload in (header.to(self.device), tensor.detach().contiguous().to(self.device)):
            self.pending.append((dist.isend(payload, self.rank + 1), payload))
        while len(self.pending) > self.max_pending:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        start = time.perf_counter()
        work, _ = self.pending.popleft()
        work.wait()
        self.wait_seconds += time.perf_counter() - start

    def flush(self) -> None:
        while self.pending:
            self._wait_oldest()

    def recv(self) -> torch.Tensor:
        start = time.perf_counter()
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.recv(header, self.rank - 1)
        header = header.cpu()
        dtype, ndim = CODE_DTYPES[int(header[0])], int(header[1])
        tensor = torch.empty([int(d) for d in header[2:2 + ndim]], dtype=dtype, device=self.device)
        dist.recv(tensor, self.rank - 1)
        self.wait_seconds += time.perf_counter() - start
        return tensor
