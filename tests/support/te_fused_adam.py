"""A CPU stand-in for Transformer Engine's FusedAdam, and megatron built as if TE were installed.

TE cannot be installed here, and on a GPU machine with TE megatron's inner optimizer is TE's
FusedAdam, whose checkpoint contract differs from torch's Adam. The stand-in keeps that contract,
read from TE 2.9's transformer_engine/pytorch/optimizers/fused_adam.py:
- the step count lives in each param group (`group["step"]`), never in a parameter's state;
- a parameter's state holds only `exp_avg`, `exp_avg_sq` (and `master_param`), and
  `state_dict()` converts each entry with `get_unscaled_state(param, name)`, which looks the name
  up in `name_to_dtype_map`: any other entry (a `step`) raises KeyError;
- `load_state_dict()` writes each entry back through `set_scaled_state`, the same lookup.
The update is Adam/AdamW with the group's step (TE's kernel, in torch ops)."""

from __future__ import annotations

import contextlib
from copy import deepcopy
from itertools import chain

import torch


class FusedAdamStandIn(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, **_):  # fmt: skip
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas,
                                      eps=eps, weight_decay=weight_decay))  # fmt: skip
        self.adam_w_mode = adam_w_mode
        self.name_to_dtype_map = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32,
                                  "master_param": torch.float32}  # fmt: skip

    def get_unscaled_state(self, param, state_name):
        dtype = self.name_to_dtype_map[state_name]  # KeyError for 'step', as in TE
        assert self.state[param][state_name].dtype == dtype
        return self.state[param][state_name]

    def set_scaled_state(self, param, state_name, unscaled_state):
        assert unscaled_state.dtype == torch.float32
        dtype = self.name_to_dtype_map[state_name]
        state = self.state[param]
        if state_name not in state:
            state[state_name] = torch.empty_like(param, dtype=dtype)
        state[state_name].copy_(unscaled_state)

    def initialize_state(self, param, store_param_remainders=False):
        for name in ("exp_avg", "exp_avg_sq"):
            self.state[param][name] = torch.zeros_like(param, dtype=torch.float32)

    def state_dict(self):
        state_dict = super().state_dict()
        saved = deepcopy(state_dict["param_groups"])
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved),
                          chain.from_iterable(g["params"] for g in self.param_groups)))  # fmt: skip
        for k, v in state_dict["state"].items():
            if k in id_map:
                state_dict["state"][k] = {n: self.get_unscaled_state(id_map[k], n) for n in v}
        return state_dict

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        saved = deepcopy(state_dict["param_groups"])
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved),
                          chain.from_iterable(g["params"] for g in self.param_groups)))  # fmt: skip
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                self.state[param] = {}
                for name in v:
                    if v[name] is not None:
                        self.set_scaled_state(param, name, v[name].float())

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            step = group["step"]
            c1 = 1 - beta1**step if group["bias_correction"] else 1.0
            c2 = 1 - beta2**step if group["bias_correction"] else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.initialize_state(p)
                st, g = self.state[p], p.grad.float()
                if not self.adam_w_mode and group["weight_decay"]:
                    g = g + group["weight_decay"] * p
                st["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (st["exp_avg"] / c1) / ((st["exp_avg_sq"] / c2).sqrt() + group["eps"])
                if self.adam_w_mode and group["weight_decay"]:
                    update = update + group["weight_decay"] * p
                p.add_(update, alpha=-group["lr"])


@contextlib.contextmanager
def megatron_with_te_adam():
    """megatron-core 0.16.1 as it runs where TE imports: `optimizer/__init__.py` builds TE's
    FusedAdam (here the stand-in) and `distrib_optimizer.py` takes the TE branches of its
    state_dict/load_state_dict (step in the param groups). Undone on exit (the pool reuses ranks)."""
    from megatron.core import optimizer as mopt
    from megatron.core.optimizer import distrib_optimizer as dopt

    saved = [(mopt, "Adam", mopt.Adam), (mopt, "USING_PYTORCH_OPTIMIZER", mopt.USING_PYTORCH_OPTIMIZER),
             (dopt, "Adam", dopt.Adam), (dopt, "HAVE_APEX_OR_TE", dopt.HAVE_APEX_OR_TE),
             (dopt, "USING_TE_OPTIMIZER", dopt.USING_TE_OPTIMIZER)]  # fmt: skip
    mopt.Adam, mopt.USING_PYTORCH_OPTIMIZER = FusedAdamStandIn, False
    dopt.Adam, dopt.HAVE_APEX_OR_TE, dopt.USING_TE_OPTIMIZER = FusedAdamStandIn, True, True
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
