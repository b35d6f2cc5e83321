"""Finishing a gguf-py GGUFWriter the way every edgetrain GGUF writer does (merged models, GGUF-LoRA)."""
from __future__ import annotations

from typing import Any


def finish_gguf(writer: Any) -> None:
    """Write the writer's header, metadata and tensors, then close it. On a failure (a full disk) its file is
    closed anyway before the error goes on: an open descriptor would keep the removed temp's space allocated
    until the process ends."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        for handle in writer.fout or []:
            try:
                handle.close()
            except OSError:  # its buffered bytes have nowhere to go either
                pass
        writer.fout = None
        raise
    writer.close()
