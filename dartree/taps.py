"""A Hugging Face target's layout (its decoder layers and final norm) and the hooks that keep the
tapped layers' outputs, which the drafter reads."""

from __future__ import annotations

import torch
from torch import nn

from .errors import require


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    require(
        isinstance(layers, nn.ModuleList),
        f"{type(model).__name__} does not expose model.layers; dartree supports decoder-only HF causal LMs "
        "(Llama, Qwen3 and the like)",
    )
    return layers


def final_norm(model: nn.Module) -> nn.Module:
    norm = getattr(getattr(model, "model", None), "norm", None)
    require(isinstance(norm, nn.Module), f"{type(model).__name__} does not expose model.norm (the final norm)")
    return norm


def check_tapped_layers(layers, n_layers: int) -> None:
    """A clear error for a tapped layer outside a target of ``n_layers`` decoder layers."""
    for i in layers:
        require(0 <= int(i) < n_layers,
                f"tapped target layer {i} is out of range: the target has {n_layers} decoder layers (0..{n_layers - 1})")


class LayerTap:
    """Forward hooks that keep the output of chosen decoder layers (equal to HF ``hidden_states[i+1]``)
    and, optionally, of the final norm, from the most recent forward."""

    def __init__(self, model: nn.Module, layers: list[int], final: bool = False):
        blocks = decoder_layers(model)
        check_tapped_layers(layers, len(blocks))
        self.layers = [int(i) for i in layers]
        self.enabled = True
        self.outputs: dict[str, torch.Tensor] = {}
        self._hooks = [blocks[i].register_forward_hook(self._hook(str(i))) for i in self.layers]
        if final:
            self._hooks.append(final_norm(model).register_forward_hook(self._hook("final")))

    def _hook(self, key: str):
        def hook(_module, _inputs, output):
            if self.enabled:
                self.outputs[key] = output[0] if isinstance(output, tuple) else output

        return hook

    def pop(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tapped layers concatenated in tap order [..., m*H], and the final norm's output (or None)."""
        feats = torch.cat([self.outputs[str(i)] for i in self.layers], dim=-1)
        final = self.outputs.get("final")
        self.outputs.clear()
        return feats, final

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
