"""The variable-batch LR rule (evenflow.lr): exact factors, exact updates, and a schedule that never sees them."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

import evenflow
import evenflow.lr
from evenflow.lr import TokenLRRule, TokenLRScaler, default_reference_tokens, lr_factor


def test_doctests():
    assert doctest.testmod(evenflow.lr).failed == 0


@pytest.mark.parametrize("tokens,scaling,expected", [
    (8192, "sqrt", 1.0), (2048, "sqrt", 0.5), (32768, "sqrt", 2.0), (0, "sqrt", 0.0),
    (2048, "linear", 0.25), (16384, "linear", 2.0), (0, "linear", 0.0), (5, "none", 1.0), (0, "none", 1.0),
])
def test_factor_table(tokens, scaling, expected):
    assert lr_factor(tokens, 8192, scaling) == pytest.approx(expected, rel=0, abs=1e-15)


@pytest.mark.parametrize("call", [lambda: lr_factor(10, 100, "cubic"), lambda: lr_factor(10, 0, "sqrt"),
                                  lambda: lr_factor(-1, 100, "sqrt"), lambda: default_reference_tokens(0),
                                  lambda: default_reference_tokens(4096, 2, True),
                                  lambda: TokenLRRule(scaling="log"), lambda: TokenLRRule(reference_tokens=0),
                                  lambda: TokenLRRule(reference_tokens=1.5)])
def test_bad_settings_are_refused(call):
    with pytest.raises(ValueError):
        call()


def test_default_reference_is_budget_times_world_times_accumulation():
    assert default_reference_tokens(4096, 2, 3) == 24576
    assert TokenLRRule().resolve(token_budget=4096, world_size=2, grad_accum_steps=3) == 24576
    assert TokenLRRule(reference_tokens=1000).resolve(token_budget=4096, world_size=2) == 1000
    assert TokenLRRule.coerce(None) is None and TokenLRRule.coerce("none") is None
    assert TokenLRRule.coerce("linear") == TokenLRRule(scaling="linear")
    with pytest.raises(TypeError):
        TokenLRRule.coerce(2.0)


def _sgd(lr=0.1):
    w = torch.nn.Parameter(torch.zeros(3))
    return w, torch.optim.SGD([w], lr=lr)


def test_each_update_uses_its_own_steps_factor_exactly():
    w, opt = _sgd(0.1)
    scaler = TokenLRScaler(opt, scaling="linear", reference_tokens=100)
    expected = torch.zeros(3)
    for tokens in (100, 25, 400, 0):
        w.grad = torch.ones(3)
        assert scaler.observe(tokens) == tokens / 100
        opt.step()
        expected -= 0.1 * tokens / 100
        assert torch.equal(w.detach(), expected), tokens
        assert scaler.last_lrs == [pytest.approx(0.1 * tokens / 100)]
        assert opt.param_groups[0]["lr"] == 0.1  # restored: the schedule's value


def test_schedule_underneath_is_untouched_chainable_and_closed_form():
    # StepLR derives the next LR from the current one: a scaled value left in place would compound.
    for make in (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
                 lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s))):
        plain_w, plain = _sgd(1.0)
        w, opt = _sgd(1.0)
        plain_sched, sched = make(plain), make(opt)
        scaler = TokenLRScaler(opt, scaling="sqrt", reference_tokens=4)
        for step, tokens in enumerate((16, 1, 9, 4, 0, 25)):
            for p, o in ((plain_w, plain), (w, opt)):
                p.grad = torch.ones(3)
            scheduled = plain.param_groups[0]["lr"]
            scaler.observe(tokens)
            plain.step()
            before = w.detach().clone()
            opt.step()
            assert torch.allclose(before - w.detach(), torch.full((3,), scheduled * math.sqrt(tokens / 4)),
                                  rtol=1e-6, atol=0), step
            plain_sched.step()
            sched.step()
            assert sched.get_last_lr() == plain_sched.get_last_lr(), step


def test_step_without_a_count_is_loud_and_counts_are_single_use():
    w, opt = _sgd()
    scaler = TokenLRScaler(opt, scaling="sqrt", reference_tokens=10)
    w.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="observe"):
        opt.step()
    scaler.observe(10)
    opt.step()
    with pytest.raises(RuntimeError, match="observe"):  # the previous step's count is not reused
        opt.step()
    scaler.remove()
    opt.step()  # detached: a plain optimizer again


def test_reference_needs_a_value_or_a_budget_and_wrappers_unwrap():
    w, opt = _sgd()
    with pytest.raises(ValueError, match="token_budget"):
        TokenLRScaler(opt)

    class Wrapper:  # accelerate / Lightning keep the torch optimizer in `.optimizer`
        def __init__(self, inner):
            self.optimizer = inner

    scaler = TokenLRScaler(Wrapper(opt), scaling="linear", token_budget=50, world_size=2, grad_accum_steps=2)
    assert scaler.reference_tokens == 200 and scaler.optimizer is opt
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        TokenLRScaler(object(), reference_tokens=1)


def test_tensor_learning_rate_stays_a_tensor():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([w], lr=torch.tensor(0.01))
    scaler = TokenLRScaler(opt, scaling="sqrt", reference_tokens=4)
    w.grad = torch.ones(2)
    scaler.observe(1)
    opt.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) and opt.param_groups[0]["lr"] == torch.tensor(0.01)
    assert torch.allclose(w.detach(), torch.full((2,), -0.005), atol=1e-7)  # Adam's first step = lr * sign


def test_exported_at_top_level():
    for name in ("TokenLRRule", "TokenLRScaler", "default_reference_tokens", "lr_factor"):
        assert name in evenflow.__all__ and getattr(evenflow, name) is getattr(evenflow.lr, name)


# -- the one-argument switch in the integrations ---------------------------------------------------------------

def _update_checks(records, reference, lr):
    """Every optimizer step moved the parameters by exactly -lr * (tokens / reference) * grad (SGD, linear)."""
    assert records, "no optimizer step ran"
    for tokens, grad, delta, factor in records:
        assert factor == pytest.approx(tokens / reference, rel=1e-12)
        assert torch.allclose(delta, -lr * tokens / reference * grad, rtol=1e-5, atol=1e-9)
    assert len({t for t, *_ in records}) > 1  # variable windows: the test would not see a constant factor


def test_hf_trainer_lr_scaling_argument(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import TrainerCallback, TrainingArguments

    import integration_scenarios as sc
    from evenflow.integrations.hf import DynamicBatchTrainer

    class Record(TrainerCallback):
        def __init__(self):
            self.trainer, self.records, self.pending = None, [], None

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            params = [p for p in model.parameters()]
            self.pending = ([p.detach().clone() for p in params], torch.cat([p.grad.reshape(-1) for p in params]))

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            before, grad = self.pending
            delta = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before)])
            scaler = self.trainer.lr_scaler
            assert optimizer.param_groups[0]["lr"] == 0.05  # the schedule's value is back before it steps
            self.records.append((self.trainer.window_tokens[-1], grad, delta, scaler.last_factor))

    class Trainer(DynamicBatchTrainer):
        window_tokens: list = []

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
            if items is not None:
                self.window_tokens.append(items)
            return batches, items

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=4,
                             gradient_accumulation_steps=2, learning_rate=0.05, optim="sgd",
                             lr_scheduler_type="constant", max_grad_norm=0.0, save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False)
    record = Record()
    trainer = Trainer(model=sc.tiny_llama(torch.float64), args=args, train_dataset=sc.ChatLike(40), token_budget=96,
                      buffer_size=16, lr_scaling="linear", callbacks=[record])
    record.trainer = trainer
    trainer.train()
    assert trainer.lr_scaler.reference_tokens == 96 * 1 * 2  # budget x world x accumulation
    _update_checks(record.records, 192, 0.05)
    off = DynamicBatchTrainer(model=sc.tiny_llama(), args=args, train_dataset=sc.ChatLike(8), token_budget=96)
    assert off.lr_rule is None and off.lr_scaler is None


def test_lightning_callback_lr_scaling_argument(tmp_path):
    L = pytest.importorskip("lightning")
    from evenflow import STEP_INFO_KEY, pop_step_info
    from evenflow.integrations.lightning import DynamicBatchDataModule, EvenflowCallback, training_loss

    import integration_scenarios as sc

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = sc.tiny_llama(torch.float64)
            self.records, self.pending, self.tokens = [], None, None

        def on_train_batch_start(self, batch, batch_idx):
            self.tokens = batch[STEP_INFO_KEY].window_loss_tokens

        def training_step(self, batch, batch_idx):
            info = pop_step_info(batch)
            return training_loss(self.model(**batch).loss, info, self.trainer)

        def on_before_optimizer_step(self, optimizer):
            params = list(self.parameters())
            self.pending = ([p.detach().clone() for p in params], torch.cat([p.grad.reshape(-1) for p in params]))

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.pending is not None:
                before, grad = self.pending
                delta = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(self.parameters(), before)])
                factor = self.trainer.callbacks[0].lr_scalers[0].last_factor
                self.records.append((self.tokens, grad, delta, factor))
                self.pending = None

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=2,
                        use_distributed_sampler=False, callbacks=[EvenflowCallback(lr_scaling="linear")],
                        default_root_dir=str(tmp_path), enable_progress_bar=False, enable_model_summary=False,
                        logger=False, enable_checkpointing=False)
    trainer.fit(module, datamodule=DynamicBatchDataModule(sc.ChatLike(40), token_budget=96, buffer_size=16))
    _update_checks(module.records, 96 * 2, 0.05)
    assert trainer.callbacks[0].lr_scalers == []  # detached at train end
    with pytest.raises(ValueError, match="scaling must be one of"):
        EvenflowCallback(lr_scaling="cubic")
