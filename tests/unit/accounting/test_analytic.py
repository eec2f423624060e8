"""The analytic ZeRO model against the ZeRO paper's arithmetic, worked by hand."""

import math

import pytest

from zerojax.accounting import analytic as A
from zerojax.accounting import planning
from zerojax.accounting.activations import GPTShape, activation_bytes_gpt
from zerojax.accounting.hardware import HARDWARE, get_hardware
from zerojax.core.optim import OPTIMIZERS, get_optimizer
from zerojax.core.precision import PRECISIONS
from zerojax.errors import UserError

PSI, P = 7e9, 8
BF16, FP32 = PRECISIONS["bf16"], PRECISIONS["fp32"]
ADAM = OPTIMIZERS["adamw"]


def _totals(policy, include_grads, optimizer=ADAM, psi=PSI, p=P):
    return [A.model_state_bytes(psi, p, s, policy, optimizer, include_grads=include_grads)["total"] for s in range(4)]


def test_bf16_adam_with_grads_is_16_bytes_per_param_sharded_per_stage():
    assert _totals(BF16, True) == pytest.approx([112e9, 38.5e9, 26.25e9, 14e9])


def test_bf16_without_grads():
    # Stage 3 shards the bf16 compute copy too: (2 + 4 + 8) / p, consistent with 16 / p with grads.
    expected = [14 * PSI, 2 * PSI + 12 * PSI / P, 2 * PSI + 12 * PSI / P, 14 * PSI / P]
    assert _totals(BF16, False) == pytest.approx(expected)


def test_fp32_without_grads_has_no_separate_master():
    expected = [12 * PSI, 4 * PSI + 8 * PSI / P, 4 * PSI + 8 * PSI / P, 12 * PSI / P]
    assert _totals(FP32, False) == pytest.approx(expected)


def test_groups_follow_the_stage_table():
    s1 = A.model_state_bytes(PSI, P, 1, BF16, ADAM)
    assert s1["compute_params"] == 2 * PSI  # replicated
    assert s1["grads"] == 2 * PSI  # stage 1 keeps full gradients
    assert s1["master"] == 4 * PSI / P and s1["optimizer"] == 8 * PSI / P
    s2 = A.model_state_bytes(PSI, P, 2, BF16, ADAM)
    assert s2["grads"] == 2 * PSI / P and s2["compute_params"] == 2 * PSI
    s3 = A.model_state_bytes(PSI, P, 3, BF16, ADAM)
    assert s3["compute_params"] == 2 * PSI / P


@pytest.mark.parametrize("name, per_param", [("adam", 8), ("sgd_momentum", 4), ("sgd", 0)])
def test_optimizer_state_per_parameter(name, per_param):
    assert A.optimizer_state_bytes(get_optimizer(name), 1000) == per_param * 1000


def test_adafactor_factored_from_shapes_and_approximated_without():
    ada = get_optimizer("adafactor")
    # 256x512 matrix factors into 256 + 512 fp32 stats; a 64-wide one (< 128) keeps full stats;
    # a vector keeps full stats; a stacked (4, 256, 512) keeps 4*256 + 4*512.
    shapes = [(256, 512), (64, 300), (512,), (4, 256, 512)]
    assert A.optimizer_state_bytes(ada, 0, shapes) == 4 * (768 + 64 * 300 + 512 + 4 * 768)
    assert A.optimizer_state_bytes(ada, 1e9) == pytest.approx(0.04e9)


def test_traffic_per_stage_7b_on_8():
    got = [A.traffic_bytes(PSI, P, s, 2) for s in range(4)]
    assert [g["param_allgather"] for g in got] == pytest.approx([0, 12.25e9, 12.25e9, 24.5e9])
    assert [g["grad_reduce"] for g in got] == pytest.approx([24.5e9, 12.25e9, 12.25e9, 12.25e9])
    assert [g["total"] for g in got] == pytest.approx([24.5e9, 24.5e9, 24.5e9, 36.75e9])


def test_one_device_moves_nothing():
    assert A.traffic_bytes(PSI, 1, 3, 2)["total"] == 0


def test_roofline_threshold_formula():
    hw = get_hardware("h100")
    # stage 3 moves 3 units: t* = 3 * 2 bytes * F / (6 * BW), BW the per-direction 450 GB/s.
    assert A.comm_bound_tokens_per_device(hw, 3) == pytest.approx(3 * 2 * 989.5e12 / (6 * 450e9))
    assert A.comm_bound_tokens_per_device(hw, 3) == pytest.approx(2198.89, abs=0.01)
    assert A.comm_bound_tokens_per_device(hw, 0, devices=8) == pytest.approx(2 * 2 * (7 / 8) * 989.5e12 / (6 * 450e9))
    # At t*, compute time equals comm time for any model size.
    for psi in (1e8, 7e9):
        t_star = A.comm_bound_tokens_per_device(hw, 2, devices=P)
        st = A.step_time_estimate(psi, P, 2, hw, t_star)
        assert st.compute_s == pytest.approx(st.comm_s)
        assert A.step_time_estimate(psi, P, 2, hw, 2 * t_star).bound == "compute"
        assert A.step_time_estimate(psi, P, 2, hw, t_star / 2).bound == "communication"


def test_a_group_that_spans_nodes_runs_at_the_rate_between_nodes():
    hw = get_hardware("h100")
    one_node, pod = A.step_time_estimate(PSI, 8, 3, hw, 4096), A.step_time_estimate(PSI, 64, 3, hw, 4096)
    assert one_node.comm_s == pytest.approx(A.traffic_bytes(PSI, 8, 3, 2)["total"] / 450e9)
    # 64 GPUs are 8 nodes of 8: each ring runs through every GPU's 400 Gb/s NIC, 50 GB/s each way
    assert pod.comm_s == pytest.approx(A.traffic_bytes(PSI, 64, 3, 2)["total"] / 50e9)
    assert A.comm_bound_tokens_per_device(hw, 3, devices=64) == pytest.approx(3 * 2 * (63 / 64) * 989.5e12 / (6 * 50e9))
    # a TPU slice is one fabric, however many chips
    v5p = get_hardware("tpu-v5p")
    assert A.step_time_estimate(PSI, 256, 3, v5p, 4096).comm_s == pytest.approx(
        A.traffic_bytes(PSI, 256, 3, 2)["total"] / 600e9
    )


def test_flops_and_time():
    assert A.flops_per_step(1e9, 1000) == 6e12
    assert A.flops_per_step(1e9, 1000, n_layers=2, d_model=10, seq_len=100) == 6e12 + 12 * 2 * 10 * 100 * 1000
    hw = get_hardware("a100")
    st = A.step_time_estimate(1e9, 4, 3, hw, 1000, mfu=0.5)
    assert st.compute_s == pytest.approx(6e12 / (312e12 * 0.5))
    assert st.comm_s == pytest.approx(3 * 2 * 1e9 * 0.75 / 300e9)


def test_activation_formula_terms():
    # full remat: 1 saved D per layer + working set 14D + 8F + 8 B/score + 6 B/logit.
    d, n, h, f, v, L, B, b = 64, 3, 4, 256, 512, 32, 2, 2
    T, S = B * L, B * h * L * L
    expected = n * T * d * b + T * (14 * d + 8 * f) * b + 8 * S + 6 * T * v
    assert activation_bytes_gpt(d, n, h, f, v, L, B, b, "full") == expected
    none = activation_bytes_gpt(d, n, h, f, v, L, B, b, "none")
    dots = activation_bytes_gpt(d, n, h, f, v, L, B, b, "dots")
    assert expected < dots < none
    # grouped-query attention: dots keeps k and v at their own width (2 x (d - kv) less per layer)
    kv = d // 4
    assert dots - activation_bytes_gpt(d, n, h, f, v, L, B, b, "dots", kv_dim=kv) == n * T * 2 * (d - kv) * b
    with pytest.raises(UserError):
        activation_bytes_gpt(d, n, h, f, v, L, B, b, "some")


def test_plan_recommends_lowest_traffic_stage_that_fits():
    hw = get_hardware("h100")  # 80 GB: stage 0 (112 GB) does not fit, 1-3 do
    p = planning.plan(PSI, P, hw, seq_len=2048, micro_batch=4)
    assert [r.fits for r in p.stages] == [False, True, True, True]
    assert p.recommendation.stage == 1  # ties with stage 2 on traffic; the lower stage wins
    t_star = A.comm_bound_tokens_per_device(hw, 1, 2, P)
    assert p.recommendation.comm_bound_below_tokens == pytest.approx(t_star)
    assert p.recommendation.min_micro_batch == math.ceil(t_star / 2048)
    # 16 GB (v5e) only holds stage 3 (14 GB); 70B on 8 fits nowhere and says how many devices would.
    assert planning.plan(PSI, P, get_hardware("tpu-v5e"), 2048, 1).recommendation.stage == 3
    none = planning.plan(70e9, P, hw, 2048, 1).recommendation
    assert none.stage is None and "14 devices" in none.reason


def test_plan_counts_activations_when_given_a_shape():
    shape = GPTShape(d_model=4096, n_layers=32, n_heads=32, d_ff=11008, vocab_size=32000)
    hw = get_hardware("h100")
    small = planning.plan(PSI, P, hw, 2048, 1, shape=shape)
    big = planning.plan(PSI, P, hw, 2048, 64, shape=shape)
    assert small.stages[3].activation_bytes > 0 and small.stages[3].fits
    assert not big.stages[3].fits  # 64 x 2048 tokens of activations no longer fit in 80 GB


def test_bad_input_is_a_user_error():
    for bad in [(0, 8), (-1, 8), (7e9, 0), (7e9, 2.5)]:
        with pytest.raises(UserError):
            A.model_state_bytes(*bad, 0, BF16, ADAM)
    with pytest.raises(UserError):
        A.model_state_bytes(PSI, P, 4, BF16, ADAM)
    with pytest.raises(UserError):
        get_optimizer("lion")
    with pytest.raises(UserError, match="a100, h100"):
        get_hardware("v100")


def test_hardware_table_is_sane():
    assert {"a100", "h100", "h200", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"} <= set(HARDWARE)
    assert get_hardware("H100").link_bytes_per_s == 450e9
    assert get_hardware("h200").hbm_bytes == 141e9
