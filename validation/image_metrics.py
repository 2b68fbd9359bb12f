"""Image similarity as the SVDQuant model cards compute it: PSNR, SSIM and LPIPS on [0, 1] RGB, per image.

The metrics are torchmetrics' (community-formats.md section 4): `peak_signal_noise_ratio(data_range=(0, 1),
dim=(1, 2, 3))` per image, `structural_similarity_index_measure(data_range=(0, 1))` and
`LearnedPerceptualImagePatchSimilarity(net_type="alex", normalize=True)`.

Identical images have an infinite PSNR, which JSON cannot hold: it is capped at `PSNR_CAP_DB` and flagged.

LPIPS needs the ImageNet AlexNet backbone; only its small linear heads ship in the torchmetrics wheel. torchmetrics
would ask torchvision to download the backbone on first use, so flux-port never lets it: the backbone weights come
from an explicit file or from the torch hub cache (where torchvision keeps its download), are loaded into the
AlexNet feature stack built here (the layout torchvision's checkpoint fits), and handed to torchmetrics' metric.
Without them LPIPS is *unavailable*, with the reason, never estimated.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from porting.errors import DeviceError, InputError

PSNR_CAP_DB = 100.0
ALEXNET_CHECKPOINT = "alexnet-owt-7be5be79.pth"  # torchvision's AlexNet_Weights.IMAGENET1K_V1 file name
LPIPS_MIN_SIDE = 32  # AlexNet's stride-4 stem and three 3x3/2 poolings need at least this many pixels
METRICS_EXTRA = "pip install 'flux-port[metrics]'"


def _torchmetrics() -> Any:
    try:
        import torchmetrics.functional.image as functional
    except ImportError as e:
        raise DeviceError("image metrics need torchmetrics, which is not installed.", hint=METRICS_EXTRA) from e
    return functional


def to_tensor(image: Any) -> torch.Tensor:
    """A PIL image or an HxWx3 uint8 array as a (1, 3, H, W) float32 tensor in [0, 1] (torchvision's ToTensor)."""
    array = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
    if array.ndim != 3 or array.shape[2] != 3:
        raise InputError(f"expected an RGB image (H x W x 3), got an array of shape {array.shape}.")
    scale = 255.0 if array.dtype == np.uint8 else 1.0
    return torch.from_numpy(np.array(array, copy=True)).permute(2, 0, 1)[None].to(torch.float32) / scale


def psnr(candidate: torch.Tensor, reference: torch.Tensor) -> tuple[float, bool]:
    """(PSNR in dB on [0, 1], capped) of one image pair; capped is True when the images are identical."""
    value = float(_torchmetrics().peak_signal_noise_ratio(candidate, reference, data_range=(0.0, 1.0),
                                                          dim=(1, 2, 3), reduction="none").reshape(-1)[0])
    if not math.isfinite(value) or value > PSNR_CAP_DB:
        return PSNR_CAP_DB, True
    return value, False


def ssim(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """SSIM with data range 1 (Gaussian window 11, sigma 1.5: torchmetrics' defaults) of one image pair."""
    return float(_torchmetrics().structural_similarity_index_measure(candidate, reference, data_range=(0.0, 1.0),
                                                                     reduction="none").reshape(-1)[0])


# ---------------------------------------------------------------------------------------------------------------
# LPIPS

def alexnet_features() -> nn.Sequential:
    """AlexNet's convolutional stack, numbered like torchvision's `alexnet().features` so its checkpoint loads."""
    return nn.Sequential(
        nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
    )


def hub_checkpoint_path() -> Path:
    """Where torchvision keeps the AlexNet download: <torch hub dir>/checkpoints/ (TORCH_HOME aware)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / ALEXNET_CHECKPOINT


@dataclass
class LpipsSource:
    """Where the AlexNet backbone comes from, or why LPIPS cannot be had: `reason` in full (compare.json, compare.md),
    `warning` in one short line naming what is missing and the option that fixes it (what port compare prints)."""

    path: Path | None
    reason: str | None = None
    warning: str | None = None

    @property
    def available(self) -> bool:
        return self.path is not None


def find_backbone(explicit: str | Path | None = None) -> LpipsSource:
    """`explicit` (must exist), else the torch hub cache; never the network."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise InputError(f"--lpips-weights {path}: no such file.",
                             hint=f"Give torchvision's AlexNet checkpoint ({ALEXNET_CHECKPOINT}).")
        return LpipsSource(path)
    cached = hub_checkpoint_path()
    if cached.is_file():
        return LpipsSource(cached)
    return LpipsSource(None, f"the AlexNet backbone weights LPIPS needs are not in the torch hub cache ({cached}) and "
                             "flux-port does not download them; pass --lpips-weights FILE (torchvision's "
                             f"{ALEXNET_CHECKPOINT})",
                       f"LPIPS skipped: no {ALEXNET_CHECKPOINT}; pass --lpips-weights FILE")


def load_backbone(path: Path) -> nn.Sequential:
    """AlexNet features from a torchvision checkpoint (.pth) or a .safetensors file; `features.` prefix optional."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises pickle, zip and runtime errors alike
        raise InputError(f"--lpips-weights {path}: not a readable checkpoint ({type(e).__name__}: {e}).") from e
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise InputError(f"--lpips-weights {path}: expected a state dict, found {type(state).__name__}.")
    features = {k.removeprefix("features."): v for k, v in state.items() if not k.startswith("classifier.")}
    net = alexnet_features()
    want = net.state_dict()
    missing = sorted(set(want) - set(features))
    unexpected = sorted(set(features) - set(want))
    wrong = [f"{k} {tuple(features[k].shape)} (AlexNet: {tuple(want[k].shape)})" for k in want
             if k in features and tuple(features[k].shape) != tuple(want[k].shape)]
    if missing or unexpected or wrong:
        raise InputError(f"--lpips-weights {path}: not AlexNet weights (missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]}, mis-shaped {wrong[:2]}).", hint=f"Use torchvision's {ALEXNET_CHECKPOINT}.")
    net.load_state_dict(features)
    return net.eval()


@contextmanager
def _backbone_for_torchmetrics(features: nn.Sequential) -> Iterator[None]:
    """Make torchmetrics build its LPIPS network around `features` instead of asking torchvision for a download.

    torchmetrics 1.x builds the AlexNet wrapper from `_get_tv_model_features` and checks torchvision is importable
    before that; both are replaced for the duration of the constructor only.
    """
    from unittest import mock

    import torchmetrics.functional.image.lpips as tm_lpips
    import torchmetrics.image.lpip as tm_metric

    def features_for(net: str, pretrained: bool = False) -> nn.Sequential:
        if net != "alex" and net != "alexnet":
            raise ValueError(f"flux-port provides the AlexNet backbone only, not {net!r}")
        return features

    if not hasattr(tm_lpips, "_get_tv_model_features") or not hasattr(tm_metric, "_TORCHVISION_AVAILABLE"):
        raise DeviceError("this torchmetrics version builds its LPIPS network differently from the 1.x releases "
                          "flux-port knows.", hint="pip install 'torchmetrics>=1.4,<2'")
    with mock.patch.object(tm_lpips, "_get_tv_model_features", features_for), \
            mock.patch.object(tm_metric, "_TORCHVISION_AVAILABLE", True):
        yield


class LpipsScorer:
    """torchmetrics' LPIPS (AlexNet, normalize=True: inputs in [0, 1]) around a given backbone."""

    def __init__(self, features: nn.Module, source: str = "injected") -> None:
        try:
            from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity
        except ImportError as e:
            raise DeviceError("LPIPS needs torchmetrics, which is not installed.", hint=METRICS_EXTRA) from e
        with _backbone_for_torchmetrics(features):
            self.metric = LearnedPerceptualImagePatchSimilarity(net_type="alex", normalize=True)
        self.source = source

    @classmethod
    def from_file(cls, path: Path) -> "LpipsScorer":
        return cls(load_backbone(path), source=str(path))

    @torch.no_grad()
    def __call__(self, candidate: torch.Tensor, reference: torch.Tensor) -> float:
        if min(candidate.shape[-2:]) < LPIPS_MIN_SIDE:
            raise InputError(f"LPIPS needs images of at least {LPIPS_MIN_SIDE} px per side, got "
                             f"{candidate.shape[-1]}x{candidate.shape[-2]}.")
        self.metric.reset()
        return float(self.metric(candidate.clamp(0, 1), reference.clamp(0, 1)))


# ---------------------------------------------------------------------------------------------------------------
# tables

def summarize(values: Sequence[float]) -> dict[str, float] | None:
    """mean, median and 90th percentile (linear interpolation), as the SVDQuant tables report them."""
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90))}


def amplified_difference(candidate: np.ndarray, reference: np.ndarray, gain: float) -> np.ndarray:
    """|candidate - reference| x gain as a uint8 RGB image (identical pixels are black)."""
    diff = np.abs(candidate.astype(np.float32) - reference.astype(np.float32)) * gain
    return np.clip(diff, 0, 255).astype(np.uint8)
