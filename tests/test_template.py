"""The template a user copies: a script and common.py alone train, a flag whose module
was not copied is refused naming the file, and README.md's worked example (a model, a
loss and an optimizer of the user's own) applied to such a copy trains, with clipping
that holds for any torch.optim optimizer."""

import re
import shutil

import pytest
import torch

import common
from harness import ROOT, TINY, assert_losses_match, run_script

# The template's own arguments: --count-comm needs options/, which a bare copy lacks.
BARE = [a for a in TINY if a != "--count-comm"]
CLIP = 0.05  # far below these runs' gradient norms: every step clips


def bare_copy(folder, script="ddp_train.py"):
    """A script and common.py, alone in an empty folder."""
    folder.mkdir()
    for name in (script, "common.py"):
        shutil.copy(ROOT / name, folder)
    return folder / script


def apply_readme_diff(path, section="## Make it yours"):
    """Apply the README section's ```diff block to `path`: each hunk's old lines (context
    and -) must appear in the file exactly once, and become the new ones (context and +)."""
    readme = (ROOT / "README.md").read_text()
    diff = re.search(r"```diff\n(.*?)```", readme[readme.index(section):], re.S).group(1)
    text = path.read_text()
    for hunk in re.split(r"^@@.*\n", diff, flags=re.M)[1:]:
        lines = hunk.rstrip("\n").split("\n")
        old = "\n".join(line[1:] for line in lines if line[:1] in (" ", "-")) + "\n"
        new = "\n".join(line[1:] for line in lines if line[:1] in (" ", "+")) + "\n"
        assert text.count(old) == 1, f"README's worked example no longer matches {path.name}:\n{old}"
        text = text.replace(old, new)
    path.write_text(text)


def record_clipped_norms(path):
    """Make the copied script write, after each clip, the norm of the gradients its
    optimizer is about to step with, one per line, to clipped.txt beside it."""
    text = path.read_text()
    clip = "        grad_norm = common.clip_grad_norm_(optimizer, args.grad_clip)\n"
    assert text.count(clip) == 1
    path.write_text(text.replace(clip, clip + "        print(float(torch.nn.utils.get_total_norm([p.grad for p in raw_model.parameters()])), "
                                              "file=open(__file__.replace('ddp_train.py', 'clipped.txt'), 'a'))\n"))


def test_a_script_and_common_alone_train_and_refuse_a_flag_whose_module_is_missing(tmp_path):
    script = bare_copy(tmp_path / "job")
    proc, records = run_script(script, 2, forked=True, base=BARE)
    assert proc.returncode == 0 and len(records) == 1 and records[0]["world_size"] == 2, proc.stderr[-3000:]
    for flag, module in (["--checkpoint-dir", tmp_path / "ckpt"], "checkpoint"), (["--simulate", "2"], "simulate"), (["--count-comm"], "count_comm"):
        proc, records = run_script(script, 1, flag, torchrun=False, forked=True, base=BARE)
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and records == [] and len(errors) == 1, proc.stderr[-3000:]
        assert errors[0] == f"error: {flag[0]} needs options/{module}.py beside common.py: copy it from the repository's options/ folder"


def test_the_readmes_worked_example_trains_a_model_of_its_own_with_its_clip(tmp_path):
    runs = {}
    for nproc in (1, 2):
        script = bare_copy(tmp_path / f"x{nproc}")
        apply_readme_diff(script)
        record_clipped_norms(script)
        proc, records = run_script(script, nproc, ["--grad-clip", CLIP], forked=True, base=BARE)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[nproc] = records[0]
        # Not common.GPT: a GRU's parameter count, not the preset's.
        assert "CharGRU" in script.read_text()
        # SGD is not fused: the gradients it steps with are the clipped ones.
        clipped = [float(line) for line in (script.parent / "clipped.txt").read_text().split()]
        assert clipped[:len(records[0]["grad_norms"])] == pytest.approx([min(n, CLIP) for n in records[0]["grad_norms"]], rel=1e-4)
    assert_losses_match(runs[2], runs[1])


def test_the_template_clips_with_a_non_fused_adamw(tmp_path):
    script = bare_copy(tmp_path / "adamw")
    text = script.read_text()
    make = "    optimizer = common.make_optimizer(raw_model, args)\n"
    assert text.count(make) == 1
    script.write_text(text.replace(make, "    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=args.lr, fused=False)\n"))
    record_clipped_norms(script)
    proc, (record,) = run_script(script, 2, ["--grad-clip", CLIP], forked=True, base=BARE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    clipped = [float(line) for line in (script.parent / "clipped.txt").read_text().split()]
    # Both ranks write each step's norm: they hold the same all-reduced gradients.
    assert clipped == pytest.approx([min(n, CLIP) for n in record["grad_norms"] for _ in range(2)], rel=1e-4)


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.AdamW(p, lr=0.1, fused=False),
                                  lambda p: torch.optim.Adam(p, lr=0.1, foreach=True), lambda p: torch.optim.AdamW(p, lr=0.1, fused=True)],
                         ids=["sgd", "adamw", "adam-foreach", "adamw-fused"])
def test_any_optimizer_steps_with_the_clipped_gradient(make):
    """The same step as torch's clip_grad_norm_ followed by the unclipped optimizer."""
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    ref.load_state_dict(model.state_dict())
    optimizer, ref_optimizer = make(model.parameters()), make(ref.parameters())
    for size in (5.0, 0.01):  # a norm far above 0.5, then one below it
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = size * torch.randn_like(p)
            q.grad = p.grad.clone()
        norm = common.clip_grad_norm_(optimizer, 0.5)
        assert torch.allclose(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
        optimizer.step()
        ref_optimizer.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
