"""The naive family (``memcalc/impls/naive.py``) on the seeds' benchmark (B=8, H=1, N=16384,
d=16, fp32, H100), figures derived by hand.

Names: NN = 8 x 16384 x 16384 x 4 B = 8,589,934,592 (one N x N fp32 tensor);
ND = 8 x 16384 x 16 x 4 B = 8,388,608 (q, k, v, grad_out, out, one grad);
ROW = 8 x 16384 x 4 B = 524,288 (a row statistic); IDX = 8 x 16384 x 8 B = 1,048,576
(int64 argmax); WS = 32 MiB = 33,554,432 (one H100 cuBLAS workspace; two threads hold one).
"""

from memcalc.config import Config
from memcalc.analysis.predict import predict

NN, ND, ROW, IDX, WS = 8_589_934_592, 8_388_608, 524_288, 1_048_576, 33_554_432


def test_naive_saved_is_exp_x_p_and_row_statistics():
    b = predict(Config(impl="naive"))
    assert b.saved_bytes == 2 * NN + ROW + IDX  # exp_x, p, row sum, argmax = 17,181,442,048
    assert sorted(c.name for c in b.saved) == ["exp_x", "p", "row_argmax", "row_sum"]


def test_naive_forward_peak():
    b = predict(Config(impl="naive"))
    # at out = p @ v: s, exp_x, p; row max, argmax, row sum; 2 workspaces; q, k, v, grad_out; out
    assert b.forward_peak_bytes == 3 * NN + 2 * ROW + IDX + 2 * WS + 4 * ND + ND  # 25,880,952,832


def test_naive_backward_peak_is_in_div_backward():
    b = predict(Config(impl="naive"))
    # in DivBackward0: exp_x, dp, e/r, e/r/r, -dp, their product; argmax, row sum;
    # 2 workspaces; q, k, v, grad_out; out; dv
    assert b.backward_peak_bytes == 6 * NN + IDX + ROW + 2 * WS + 4 * ND + ND + ND  # 51,658,620,928
    assert b.peak_bytes == b.backward_peak_bytes
    assert b.peak_phase == "backward"


def test_softmax_saves_only_the_weights():
    b = predict(Config(impl="naive-softmax"))
    assert b.saved_bytes == NN  # p
    assert b.forward_peak_bytes == 2 * NN + 2 * WS + 4 * ND + ND  # s, p, ws, inputs, out = 17,288,921,088
    # p, dp, dscores and CUDA's grad * p inside _softmax_backward_data; out, dv
    assert b.backward_peak_bytes == 4 * NN + 2 * WS + 4 * ND + 2 * ND  # 34,477,178,880


def test_weights_only_function_holds_four_nn_in_backward():
    b = predict(Config(impl="naive-weights"))
    assert b.saved_bytes == NN  # p (q, k, v are inputs)
    assert b.backward_peak_bytes == 4 * NN + 2 * WS + 4 * ND + 2 * ND  # p, dp, dsm, ds = 34,477,178,880
