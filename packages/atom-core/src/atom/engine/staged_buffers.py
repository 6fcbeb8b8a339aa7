"""Named device tensors in one device buffer, written from one pinned host buffer.

Static inputs (of a CUDA graph, say) are filled on the host through numpy views and reach
the device in a single asynchronous copy. An event guards the host buffer: it is not
rewritten while the previous copy may still be reading it.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64


class StagedBuffers:
    def __init__(self, fields: dict[str, tuple[torch.dtype, tuple[int, ...]]], device):
        self.device_type = torch.device(device).type
        self.offsets: dict[str, int] = {}
        self.row_bytes: dict[str, int] = {}
        total = 0
        for name, (dtype, shape) in fields.items():
            size = dtype.itemsize * int(np.prod(shape))
            self.offsets[name] = total
            self.row_bytes[name] = size // shape[0]
            total += -(-size // _ALIGN) * _ALIGN
        pinned = self.device_type == "cuda"
        self.host_bytes = torch.zeros(total, dtype=torch.uint8, pin_memory=pinned)
        self.device_bytes = torch.zeros(total, dtype=torch.uint8, device=device)
        self.device: dict[str, torch.Tensor] = {}
        self._host: dict[str, np.ndarray] = {}
        for name, (dtype, shape) in fields.items():
            begin = self.offsets[name]
            end = begin + dtype.itemsize * int(np.prod(shape))
            self.device[name] = self.device_bytes[begin:end].view(dtype).view(shape)
            self._host[name] = self.host_bytes[begin:end].view(dtype).view(shape).numpy()
        self._copied = torch.cuda.Event() if pinned else None

    def host(self) -> dict[str, np.ndarray]:
        """The host views, once the last upload has finished reading them."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host

    def end_of(self, name: str, rows: int) -> int:
        """Byte offset just past the first `rows` rows of a field."""
        return self.offsets[name] + rows * self.row_bytes[name]

    def upload(self, num_bytes: int | None = None) -> None:
        """Copies the first num_bytes (default: all) of the host buffer to the device."""
        end = self.host_bytes.numel() if num_bytes is None else num_bytes
        self.device_bytes[:end].copy_(self.host_bytes[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
