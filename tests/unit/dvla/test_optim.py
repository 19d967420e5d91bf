"""dvla's learner optimizer computes what torch's Adam and AdamW compute, bit for bit, and
imports no torch._dynamo until something else does (then torch's own wrappers run)."""

import subprocess
import sys


SCRIPT = r'''
import sys
import torch
from dvla.algos.optim import adam

def train(make, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    opt = make(model.parameters())
    for i in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 5, generator=torch.Generator().manual_seed(i))).square().sum().backward()
        opt.step()
        if i == 1:  # a state_dict round trip mid-way, as a checkpoint resume does
            opt.load_state_dict(opt.state_dict())
    return [p.detach().clone() for p in model.parameters()], opt

CASES = ((0.0, torch.optim.Adam), (0.01, torch.optim.AdamW))
for decay, cls in CASES:
    ours, opt = train(lambda ps: adam(ps, lr=1e-2, eps=1e-5, weight_decay=decay))
    assert "torch._dynamo" not in sys.modules, "imported by dvla's optimizer"
    assert type(opt).__name__ == cls.__name__ and isinstance(opt, cls), type(opt)
    theirs, _ = train(lambda ps: cls(ps, lr=1e-2, eps=1e-5, weight_decay=decay))  # (imports it)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), cls
    again, _ = train(lambda ps: adam(ps, lr=1e-2, eps=1e-5, weight_decay=decay))  # torch's wrappers now
    assert all(torch.equal(a, b) for a, b in zip(again, theirs)), cls
    if decay == 0.0:
        del sys.modules["torch._dynamo"]  # AdamW starts without it too (its submodules stay loaded)
print("ok")
'''


def test_dvla_adam_is_torch_adam_to_the_bit_without_importing_dynamo():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_an_optimizer_whose_methods_torch_does_not_wrap_is_left_as_it_is():
    import torch

    from dvla.algos.optim import without_dynamo_import

    class Plain(torch.optim.Optimizer):
        def step(self, closure=None):
            return None

    assert without_dynamo_import(Plain) is Plain
    assert without_dynamo_import(torch.optim.Adam) is without_dynamo_import(torch.optim.Adam)  # one class each
