"""Gradient rules: elementwise ops. Broadcasting ops return output-shaped gradients (broadcast=True)."""

from __future__ import annotations

from gradgen.grads.registry import grad_rule


@grad_rule("Add", broadcast=True)
def add(g):
    return [g.dy(), g.dy()]


@grad_rule("Sub", broadcast=True)
def sub(g):
    return [g.dy(), g.op("Neg", g.dy()) if g.needs(1) else None]


@grad_rule("Mul", broadcast=True)
def mul(g):
    a, b = g.x(0), g.x(1)
    return [g.op("Mul", g.dy(), b) if g.needs(0) else None,
            g.op("Mul", g.dy(), a) if g.needs(1) else None]


@grad_rule("Relu")
def relu(g):
    mask = g.op("Greater", g.x(0), g.const_like(g.x(0), 0.0))
    return [g.op("Where", mask, g.dy(), g.const_like(g.x(0), 0.0))]


@grad_rule("Sum", broadcast=True)
def sum_(g):
    return [g.dy()] * len(g.node.inputs)
