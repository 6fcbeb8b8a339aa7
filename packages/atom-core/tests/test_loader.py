"""atom.loader's post-load pass: the hook order layers rely on, and a host's skipped layers."""

from __future__ import annotations

from torch import nn

from atom.loader import process_weights_after_loading


class Hooked(nn.Module):
    def __init__(self, name: str, calls: list[str], child: nn.Module | None = None):
        super().__init__()
        self.name, self.calls, self.child = name, calls, child

    def process_weights_after_loading(self) -> None:
        self.calls.append(self.name)


def test_post_load_hooks_run_in_module_order_except_skipped_modules():
    calls: list[str] = []
    host_layer = Hooked("host_layer", calls, child=Hooked("host_child", calls))
    model = nn.Sequential(
        Hooked("kv_b_proj", calls),
        host_layer,
        Hooked("attn", calls, child=Hooked("impl", calls)),
    )
    process_weights_after_loading(model)
    assert calls == ["kv_b_proj", "host_layer", "host_child", "attn", "impl"]
    calls.clear()
    process_weights_after_loading(model, skip=list(host_layer.modules()))
    assert calls == ["kv_b_proj", "attn", "impl"]
