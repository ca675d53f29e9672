"""Finite-difference cases: the com.microsoft gradient ops gradgen emits, differentiated again (a
backward graph's own gradient: Hessian-vector products, gradient penalties)."""

import numpy as np

from tests.gradcheck import GradCase

MS = "com.microsoft"
rng = np.random.default_rng(15)


def r(*shape):
    return rng.uniform(-2.0, 2.0, shape)


def i64(*values, shape=None):
    a = np.array(values, dtype=np.int64)
    return a.reshape(shape) if shape is not None else a


CASES = [
    # SliceGrad(dY, shape, starts, ends[, axes[, steps]]): a window with a step, and a negative step.
    GradCase("SliceGrad", [r(2, 3), i64(4, 5), i64(1, 0), i64(3, 5), i64(0, 1), i64(1, 2)], domain=MS, name="SliceGrad_steps"),
    GradCase("SliceGrad", [r(3, 2), i64(3, 4), i64(-1), i64(-5), i64(1), i64(-2)], domain=MS, name="SliceGrad_negative_step"),
    GradCase("SliceGrad", [r(2, 4), i64(5, 4), i64(1), i64(3)], domain=MS, name="SliceGrad_no_axes"),
    # GatherGrad(shape, indices, dY) and GatherElementsGrad(dY, shape, indices): repeated, negative.
    GradCase("GatherGrad", [i64(5, 3), i64(0, 2, 2, -1), r(4, 3)], domain=MS, name="GatherGrad_axis0"),
    GradCase("GatherGrad", [i64(2, 4, 3), i64(3, -4, 1, 1, shape=(2, 2)), r(2, 2, 2, 3)], attrs={"axis": 1}, domain=MS),
    GradCase(
        "GatherElementsGrad",
        [r(2, 4), i64(3, 4), i64(0, 2, 2, 1, -1, 0, 0, 0, shape=(2, 4))],
        domain=MS,
        name="GatherElementsGrad_0",
    ),
    GradCase(
        "GatherElementsGrad",
        [r(3, 3), i64(3, 4), i64(3, 3, -1, 0, 1, 1, 2, 0, 0, shape=(3, 3))],
        attrs={"axis": 1},
        domain=MS,
        name="GatherElementsGrad_1",
    ),
    # ConvGrad(dY, X, W) -> (dX, dW, dB): grouped and strided with pads; dilated 1-D; dX and dW only.
    GradCase(
        "ConvGrad",
        [r(2, 4, 3, 3), r(2, 4, 5, 5), r(4, 2, 3, 3)],
        attrs={"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1], "kernel_shape": [3, 3]},
        domain=MS,
        num_outputs=3,
        name="ConvGrad_group_stride",
    ),
    GradCase(
        "ConvGrad",
        [r(1, 2, 4), r(1, 3, 7), r(2, 3, 2)],
        attrs={"dilations": [3], "kernel_shape": [2]},
        domain=MS,
        num_outputs=2,
        name="ConvGrad_dilated_1d",
    ),
    # LayerNormalizationGrad(dY, X, scale, mean, inv_std): five independent inputs (its rule's
    # gradients of mean and inv_std reach X through LayerNormalization's rule).
    GradCase(
        "LayerNormalizationGrad",
        [r(2, 3, 4), r(2, 3, 4), r(4), r(2, 3, 1), rng.uniform(0.5, 2.0, (2, 3, 1))],
        domain=MS,
        num_outputs=3,
        name="LayerNormalizationGrad_last",
    ),
    GradCase(
        "LayerNormalizationGrad",
        [r(2, 3, 2), r(2, 3, 2), r(3, 2), r(2, 1, 1), rng.uniform(0.5, 2.0, (2, 1, 1))],
        attrs={"axis": 1},
        domain=MS,
        num_outputs=2,
        name="LayerNormalizationGrad_axis1",
    ),
    # BatchNormalizationGrad(dY, X, scale, saved_mean, saved_inv_std): per channel (axis 1), ranks 2 to
    # 4; its gradients of the saved statistics reach X through BatchNormInternal's rule.
    *(
        GradCase(
            "BatchNormalizationGrad",
            [r(*shape), r(*shape), r(shape[1]), r(shape[1]), rng.uniform(0.5, 2.0, shape[1])],
            attrs={"epsilon": 1e-5},
            domain=MS,
            num_outputs=3,
            name=f"BatchNormalizationGrad_{len(shape)}d",
        )
        for shape in ((4, 2), (2, 2, 3), (2, 3, 2, 2))
    ),
    # FusedMatMul: each transpose flag, alpha, broadcast batch dims.
    GradCase("FusedMatMul", [r(2, 3, 4), r(5, 4)], attrs={"transB": 1, "alpha": 0.5}, domain=MS, name="FusedMatMul_transB"),
    GradCase("FusedMatMul", [r(4, 3), r(2, 4, 5)], attrs={"transA": 1}, domain=MS, name="FusedMatMul_transA"),
    GradCase(
        "FusedMatMul",
        [r(1, 4, 3), r(3, 5, 4)],
        attrs={"transA": 1, "transB": 1, "alpha": -2.0},
        domain=MS,
        name="FusedMatMul_both",
    ),
]

# ONNX Runtime training's gradient ops that gradgen runs: ReluGrad (X away from the kink), SigmoidGrad
# and TanhGrad (Y a real Sigmoid / Tanh output),
# SoftmaxGrad_13 / LogSoftmaxGrad_13 (Y a real (log-)softmax output, on two axes).
_x = r(3, 4)
_x[np.abs(_x) < 0.1] = 0.5


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


CASES += [
    GradCase("ReluGrad", [r(3, 4), _x], domain=MS, name="ReluGrad"),
    GradCase("SigmoidGrad", [r(3, 4), 1 / (1 + np.exp(-r(3, 4)))], domain=MS, name="SigmoidGrad"),
    GradCase("TanhGrad", [r(3, 4), np.tanh(r(3, 4))], domain=MS, name="TanhGrad"),
    GradCase("GeluGrad", [r(3, 4), r(3, 4)], domain=MS, name="GeluGrad"),
    GradCase("FastGeluGrad", [r(3, 4), r(3, 4)], domain=MS, name="FastGeluGrad"),
    GradCase("BiasGeluGrad_dX", [r(2, 3, 4), r(2, 3, 4), r(4)], domain=MS, name="BiasGeluGrad_dX"),
    GradCase("BiasFastGeluGrad_dX", [r(3, 4), r(3, 4), r(4)], domain=MS, name="BiasFastGeluGrad_dX"),
    GradCase("SoftmaxGrad_13", [r(2, 3, 4), _softmax(r(2, 3, 4), -1)], domain=MS, name="SoftmaxGrad_13_last"),
    GradCase("SoftmaxGrad_13", [r(2, 3, 4), _softmax(r(2, 3, 4), 1)], attrs={"axis": 1}, domain=MS, name="SoftmaxGrad_13_axis1"),
    GradCase("LogSoftmaxGrad_13", [r(2, 3, 4), np.log(_softmax(r(2, 3, 4), -1))], domain=MS, name="LogSoftmaxGrad_13_last"),
    GradCase(
        "LogSoftmaxGrad_13",
        [r(3, 5), np.log(_softmax(r(3, 5), 0))],
        attrs={"axis": 0},
        domain=MS,
        name="LogSoftmaxGrad_13_axis0",
    ),
]

# SoftmaxCrossEntropyLossGrad(dY, log_prob, label[, weight]): the gradient gradgen emits for
# SoftmaxCrossEntropyLoss, differentiated again (dY and log_prob; the weights held constant), with
# an ignored label, for each reduction and a (N, C, D) layout.
CASES += [
    GradCase(
        "SoftmaxCrossEntropyLossGrad",
        [np.array(1.3), np.log(_softmax(r(4, 5), 1)), i64(0, 3, -100, 2)],
        attrs={"reduction": "mean", "ignore_index": -100},
        domain=MS,
        name="SoftmaxCrossEntropyLossGrad_mean",
    ),
    GradCase(
        "SoftmaxCrossEntropyLossGrad",
        [np.array(0.7), np.log(_softmax(r(3, 4, 2), 1)), i64(1, 3, 0, -1, 2, 2, shape=(3, 2)), r(4) + 3.0],
        attrs={"reduction": "sum", "ignore_index": -1},
        domain=MS,
        const=(3,),
        name="SoftmaxCrossEntropyLossGrad_sum_weights_3d",
    ),
    GradCase(
        "SoftmaxCrossEntropyLossGrad",
        [r(4), np.log(_softmax(r(4, 5), 1)), i64(4, 0, 1, 1)],
        attrs={"reduction": "none"},
        domain=MS,
        name="SoftmaxCrossEntropyLossGrad_none",
    ),
    GradCase(
        "SoftmaxCrossEntropyLossGrad",
        [np.array(2.0), np.log(_softmax(r(3, 4), 1)), i64(1, 0, 3), r(4) + 3.0],
        attrs={"reduction": "mean"},
        domain=MS,
        const=(3,),
        name="SoftmaxCrossEntropyLossGrad_mean_weights",
    ),
]


def _coerced_softmax(x, axis):
    """Softmax before opset 13: x coerced to 2-D at ``axis``, normalised over every axis from it."""
    flat = x.reshape(int(np.prod(x.shape[:axis])), -1)
    return _softmax(flat, 1).reshape(x.shape)


# The other ONNX Runtime training gradient ops gradgen runs (its training graphs): SoftmaxGrad /
# LogSoftmaxGrad before opset 13 (the sums over every axis from `axis`), SimplifiedLayerNormalizationGrad,
# Scale (times and divided by), and the pooling gradients (whose ops sit in the ONNX domain).
_pooled = r(2, 2, 3, 3)
CASES += [
    GradCase(
        "SoftmaxGrad", [r(2, 3, 4), _coerced_softmax(r(2, 3, 4), 1)], attrs={"axis": 1}, domain=MS, name="SoftmaxGrad_axis1"
    ),
    GradCase("SoftmaxGrad", [r(3, 5), _coerced_softmax(r(3, 5), 1)], domain=MS, name="SoftmaxGrad_default"),
    GradCase(
        "LogSoftmaxGrad",
        [r(2, 3, 2), np.log(_coerced_softmax(r(2, 3, 2), 2))],
        attrs={"axis": 2},
        domain=MS,
        name="LogSoftmaxGrad_axis2",
    ),
    GradCase(
        "SimplifiedLayerNormalizationGrad",
        [r(2, 3, 4), r(2, 3, 4), r(4), rng.uniform(0.5, 2.0, (2, 3, 1))],
        domain=MS,
        num_outputs=2,
        name="SimplifiedLayerNormalizationGrad_last",
    ),
    GradCase(
        "SimplifiedLayerNormalizationGrad",
        [r(2, 3, 2), r(2, 3, 2), r(3, 2), rng.uniform(0.5, 2.0, (2, 1, 1))],
        attrs={"axis": 1},
        domain=MS,
        num_outputs=2,
        name="SimplifiedLayerNormalizationGrad_axis1",
    ),
    GradCase("Scale", [r(3, 4), np.array([1.7])], domain=MS, name="Scale_times"),
    # the kernel divides by float32(s): differences in steps of 1e-3 see past that rounding
    GradCase("Scale", [r(3, 4), np.array([-0.6])], attrs={"scale_down": 1}, domain=MS, name="Scale_divided", eps=1e-3, rtol=1e-4),
    GradCase(
        "MaxPoolGrad",
        [r(2, 2, 2, 2), np.array([0, 2, 4, 8, 9, 12, 14, 15, 19, 20, 25, 26, 27, 28, 33, 35]).reshape(2, 2, 2, 2)],
        attrs={"kernel_shape": [2, 2], "strides": [1, 1]},
        name="MaxPoolGrad_2x2",
        checked=False,  # ONNX's checker does not know ONNX Runtime's ops of the ONNX domain
    ),
    GradCase(
        "AveragePoolGrad",
        [r(2, 2, 2, 2)],
        attrs={"kernel_shape": [2, 2], "strides": [1, 1]},
        name="AveragePoolGrad_2x2",
        checked=False,
    ),
    GradCase(
        "AveragePoolGrad",
        [r(1, 2, 3, 2)],
        attrs={"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1], "count_include_pad": 1},
        name="AveragePoolGrad_pads_include",
        checked=False,
    ),
    GradCase(
        "AveragePoolGrad",
        [r(1, 1, 3)],
        attrs={"kernel_shape": [2], "strides": [2], "pads": [1, 1]},
        name="AveragePoolGrad_1d_pads",
        checked=False,
    ),
]
