"""The NatureCNN pixel encoder (Mnih et al. 2015) with every layer addressable by name.

Layers ``conv_0`` .. ``conv_2`` (:data:`NATURE_CONVS`), each a :class:`ConvLayer` with
children ``conv`` and ``act`` (ReLU), then ``fc``, a :class:`~policy_probes.layers.HiddenLayer`
of 512 ReLU units on the flattened feature map. A probe on ``encoder.conv_1`` sees that
layer's post-activation feature map, one on ``encoder.conv_1.conv`` its pre-activation.
"""

from __future__ import annotations

import torch
from torch import nn

from policy_probes.layers import ConvLayer, HiddenLayer

#: (out_channels, kernel_size, stride) of the three convolutions
NATURE_CONVS = ((32, 8, 4), (64, 4, 2), (64, 3, 1))
NATURE_FEATURES = 512
#: pixel values are divided by this before the first convolution
PIXEL_MAX = 255.0


def conv_output_size(size: int, kernel: int, stride: int) -> int:
    """Spatial size after an unpadded convolution."""
    return (size - kernel) // stride + 1


class NatureCNN(nn.Module):
    """Raw pixels ``(..., C, H, W)`` (or flattened ``(..., C*H*W)``, as the rollout storage
    holds them), values 0..255, to ``(..., 512)`` ReLU features. The forward scales them by
    1/255, so observations stay uint8 everywhere else (a quarter of float32's memory).
    """

    def __init__(self, observation_shape: tuple[int, int, int], layer_norm: bool = False) -> None:
        super().__init__()
        channels, height, width = observation_shape
        self.observation_shape = (int(channels), int(height), int(width))
        in_channels = channels
        for i, (out_channels, kernel, stride) in enumerate(NATURE_CONVS):
            height = conv_output_size(height, kernel, stride)
            width = conv_output_size(width, kernel, stride)
            if height < 1 or width < 1:
                raise ValueError(
                    f"NatureCNN needs frames of at least 36x36 pixels, got "
                    f"{observation_shape[1]}x{observation_shape[2]} (conv_{i} has no output "
                    f"left); raise env.atari.screen_size"
                )
            self.add_module(
                f"conv_{i}",
                ConvLayer(in_channels, out_channels, kernel, stride, "relu", layer_norm),
            )
            in_channels = out_channels
        self.flat_features = in_channels * height * width
        self.fc = HiddenLayer(self.flat_features, NATURE_FEATURES, "relu", layer_norm)
        self.out_features = NATURE_FEATURES

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        shape = self.observation_shape
        if tuple(obs.shape[-3:]) == shape:
            lead = obs.shape[:-3]
        elif obs.shape[-1] == shape[0] * shape[1] * shape[2]:
            lead = obs.shape[:-1]
        else:
            raise ValueError(
                f"NatureCNN built for observations of shape {shape} (or flattened to "
                f"{shape[0] * shape[1] * shape[2]}) got a batch of shape {tuple(obs.shape)}"
            )
        x = obs.reshape(-1, *shape).float() / PIXEL_MAX
        x = self.conv_2(self.conv_1(self.conv_0(x)))
        return self.fc(x.flatten(1)).view(*lead, NATURE_FEATURES)
