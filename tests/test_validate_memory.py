"""`port validate --reference cuda|npu`: the host's share of the run is estimated and refused before any work, as on
the CPU reference. The decision is a pure function of the request (device kinds, config, weights' shapes, options)
and the memory available, so it is tested here on a machine without any accelerator, on klein-9B's real headers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from porting.devices import free_memory
from porting.resources import ResourceError
from validation.memory import check_device, check_devices, check_host, graph_bytes, host_need, request_for
from validation.weights import WeightSource

from .helpers import REAL2, meta_shapes, write_header_only

GIB = 2**30


@pytest.fixture(scope="module")
def klein9b(tmp_path_factory):
    """klein-9B in original naming, header only (a sparse file: ~no disk), opened as validate opens it."""
    path = write_header_only(tmp_path_factory.mktemp("k9") / "klein-9b.safetensors", meta_shapes(REAL2["klein-9B"]))
    yield WeightSource(path)
    path.unlink()


def request(source, reference="cuda", device="cuda", resolution=1024, text_len=512, batch=3, golden="fp32"):
    return request_for(source, reference=reference, device=device, resolution=resolution, text_len=text_len,
                       batch=batch, golden_dtype=golden, dtype="bf16")


def refusal(req, available: int) -> str:
    with pytest.raises(ResourceError) as err:
        check_host(req, available=available)
    assert err.value.exit_code == 2
    return f"{err.value} {err.value.hint}"


def test_a_cuda_reference_is_estimated_on_the_host_and_fits_where_the_cpu_golden_would_not(klein9b):
    gpu, cpu = request(klein9b), request(klein9b, reference="cpu", device="cpu")
    need, terms = host_need(gpu)
    assert {t.name for t in terms} == {"staging", "compare", "inputs"}  # nothing of the golden's stage on the host
    assert 6 * GIB < need < 8 * GIB  # klein-9B at 1024 x 3 timesteps: the weights staged, float64 compares
    assert check_host(gpu, available=8 * GIB) == need  # an 8 GiB host runs it with the golden on the GPU ...
    assert check_host(cpu, available=24 * GIB) > need + GIB  # ... not with the golden's whole block on the host
    with pytest.raises(ResourceError):
        check_host(cpu, available=8 * GIB)


def test_the_refusal_names_the_need_what_is_available_and_the_option_that_lowers_it(klein9b):
    req = request(klein9b, resolution=4096)  # 65,536 image tokens: the float64 compares dominate
    need, _ = host_need(req)
    text = refusal(req, need - 1)
    assert "golden on cuda at --resolution 4096 --text-len 512, 3 case(s)" in text
    assert f"needs about {need / GIB:.2f} GiB" in text and f"{(need - 1) / GIB:.2f} GiB is available" in text
    assert "nothing was done" in text
    assert "The largest part is compare: a lower --resolution or --text-len, or fewer --seeds / --timesteps" in text
    assert check_host(req, available=need) == need  # the boundary: exactly enough passes


def test_a_cpu_device_under_test_is_counted_and_the_hint_moves_it_to_the_accelerator(klein9b):
    on_gpu, on_cpu = request(klein9b, resolution=256, batch=1), request(klein9b, device="cpu", resolution=256, batch=1)
    extra = host_need(on_cpu)[0] - host_need(on_gpu)[0]
    assert extra > 2 * GIB  # the largest block in bf16 and the tensor read, on the host
    assert "The largest part is candidate: --device cuda (the device under test on the accelerator)" in \
        refusal(on_cpu, host_need(on_cpu)[0] - 1)


def test_an_fp64_golden_stages_at_8_bytes_and_the_hint_says_so(klein9b):
    fp32, fp64 = request(klein9b, resolution=256, batch=1), request(klein9b, resolution=256, batch=1, golden="fp64")
    assert host_need(fp64)[0] > host_need(fp32)[0]
    assert "The largest part is staging: --golden-dtype fp32" in refusal(fp64, GIB)
    assert "free memory or use a larger host" in refusal(fp32, GIB)


def test_text_encoders_run_before_the_stages_and_count_against_them_not_with_them(klein9b):
    req = request(klein9b, resolution=256, batch=1)
    base, _ = host_need(req)
    small = dataclasses.replace(req, encoder_bytes=GIB)  # smaller than the stages' share: no change
    assert host_need(small)[0] == base
    big = dataclasses.replace(req, encoder_bytes=40 * GIB)  # FLUX.2-dev's Mistral 3 in float32 is ~96 GB
    assert host_need(big)[0] > 40 * GIB and "The largest part is encoders: no --prompt" in refusal(big, 8 * GIB)


def test_npu_is_estimated_like_cuda(klein9b):
    assert host_need(request(klein9b, reference="npu", device="npu"))[0] == host_need(request(klein9b))[0]
    assert "golden on npu" in refusal(request(klein9b, reference="npu", device="npu"), GIB)


def test_device_memory_refusals_name_the_device_and_the_way_out(klein9b):
    req = request(klein9b)
    with pytest.raises(ResourceError) as err:
        check_device(req, "cuda:0", golden=True, free=4 * GIB)
    assert "fp32 golden on cuda:0" in str(err.value) and "4.00 GiB is available" in str(err.value)
    assert "--reference cpu" in err.value.hint
    assert check_device(req, "cuda:0", golden=True, free=80 * GIB) < 80 * GIB  # an H100 holds it
    with pytest.raises(ResourceError) as err:
        check_device(req, "npu:1", golden=False, free=GIB)
    assert "running --dtype bf16 on npu:1" in str(err.value) and "--reference cpu" not in err.value.hint
    assert check_device(req, "npu:1", golden=False, free=16 * GIB) < 16 * GIB


def test_no_device_memory_is_queried_for_the_cpu(klein9b):
    assert free_memory(torch.device("cpu")) is None
    check_devices(request(klein9b, reference="cpu", device="cpu", resolution=10**6), torch.device("cpu"),
                  torch.device("cpu"))  # a host-sized request: nothing here is a device's to refuse


def test_an_onnxruntime_session_on_the_cpu_is_the_candidate_the_host_holds(klein9b, tmp_path):
    graph = tmp_path / "model.onnx"
    graph.write_bytes(b"g" * 1000)
    (tmp_path / "model.onnx.data").write_bytes(b"w" * 5000)
    assert graph_bytes(graph) == 6000
    req = dataclasses.replace(request(klein9b, device=None, resolution=256, batch=1), session_bytes=36 * GIB)
    need, terms = host_need(req)  # a klein-9B fp32 export: 36 GB held by the CPU session beside the compares
    assert need > 36 * GIB and "the onnxruntime session on the cpu" in next(t.detail for t in terms
                                                                            if t.name == "candidate")
    assert "The largest part is candidate: --provider CUDAExecutionProvider" in refusal(req, 16 * GIB)
    on_cpu = dataclasses.replace(req, reference="cpu")  # the CPU golden's estimate holds the session too
    plain = check_host(dataclasses.replace(on_cpu, session_bytes=0), available=64 * GIB)
    assert check_host(on_cpu, available=64 * GIB) > plain + 36 * GIB
    assert "--provider CUDAExecutionProvider" in refusal(on_cpu, 36 * GIB)
