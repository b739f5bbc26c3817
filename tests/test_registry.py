"""The drafter registry: every kind reachable from the CLI and the API, the +lookup forms derived,
a new drafter usable from one entry, and the MLX path free of torch."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_cli import tiny_llama as tiny_llama_dir

import mlxspec
from mlxspec.cli.main import bench, chat, generate, main
from mlxspec.drafters import registry
from mlxspec.drafters.registry import DrafterKind, host_only
from mlxspec.engine import Draft, Drafter

PROMPT = "Repeat: the cat sat on the mat, the cat sat on the mat."


@pytest.fixture(scope="module")
def tiny_dir(smollm_dir, tmp_path_factory):
    """A 1-layer random llama with SmolLM2's tokenizer; also a draft model for itself."""
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "target", smollm_dir, 49152)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return mlxspec.load(tiny_dir)


@pytest.fixture(scope="module")
def checkpoints(tiny_dir, tmp_path_factory):
    """A checkpoint that fits the tiny target for each model drafter (a new one adds its own)."""
    from test_dflash import drafter_config, random_weights, save_drafter

    config = drafter_config(vocab=49152, hidden=64, target_layers=1, num_hidden_layers=1,
                            layer_types=["full_attention"], target_layer_ids=[0], mask_token_id=0)
    dflash = save_drafter(tmp_path_factory.mktemp("dflash"), config, random_weights(config))
    from test_eagle3 import make_drafter_dir as eagle3_dir

    eagle3 = eagle3_dir(tmp_path_factory.mktemp("eagle3"), vocab=49152, draft_ids=list(range(16)),
                        hidden=64, target_hidden=64, ids=(1, 1, 1))
    from test_medusa import write_heads

    medusa = write_heads(tmp_path_factory.mktemp("medusa"), hidden=64, vocab=49152)
    from test_dflash2 import dflash2_config, dflash2_weights

    config2 = dflash2_config(vocab=49152, hidden=64, target_layers=1, num_hidden_layers=1,
                             layer_types=["full_attention"], target_layer_ids=[0],
                             mask_token_id=0)
    dflash2 = save_drafter(tmp_path_factory.mktemp("dflash2"), config2, dflash2_weights(config2))
    from test_dspark import make_dir as dspark_dir

    dspark = dspark_dir(tmp_path_factory.mktemp("dspark"), "lfm", vocab=49152, hidden=64,
                        target_layers=1, target_layer_ids=[0], mask_token_id=0)
    return {"draft": tiny_dir, "dflash": dflash, "dflash2": dflash2, "dspark": dspark,
            "eagle3": eagle3, "medusa": medusa}


def choices(command, name="drafter"):
    return tuple(next(p for p in command.params if p.name == name).type.choices)


def invoke(*args):
    return CliRunner().invoke(main, list(args))


# ---- Every kind, from the CLI and the API ---------------------------------------------------


def test_every_kind_is_offered_by_the_cli():
    names = registry.drafter_names()
    assert names == mlxspec.drafters.DRAFTER_KINDS
    assert choices(generate) == choices(chat) == names
    bench_flags = {p.name for p in bench.params}
    for kind in registry.model_drafters():
        assert f"{kind.name}_model" in bench_flags  # bench's --NAME-model
    for option in registry.drafter_options():
        for command in (generate, chat, bench):
            assert option.name in {p.name for p in command.params}, (option.name, command.name)


def test_every_kind_builds_from_the_api(tiny, checkpoints):
    """Every kind builds on the tiny llama, but those that need what it lacks (MTP modules, a
    second layer for LayerSkip), which say so in one line, the line bench reports when it skips them (tests/test_mtp.py
    builds mtp on targets that ship modules)."""
    model, tokenizer = tiny
    lacking = {name for name in registry._REGISTERED if registry.why_unavailable(name, model)}
    assert lacking == {"mtp", "layerskip"}  # modules; a second layer to exit after
    assert set(checkpoints) == {k.name for k in registry.model_drafters()} - lacking
    for name, kind in registry.drafter_kinds().items():
        if kind.model_name in lacking:
            reason = registry.why_unavailable(name, model)
            with pytest.raises(ValueError, match=re.escape(reason)):
                mlxspec.load_drafter(name, model=model, tokenizer=tokenizer)
            continue
        path = checkpoints.get(kind.model_name) if kind.checkpoint else None
        drafter = mlxspec.load_drafter(name, path, model=model, tokenizer=tokenizer)
        assert drafter.name == name
    with pytest.raises(ValueError, match="unknown drafter 'hydra'; choose from none, lookup"):
        mlxspec.load_drafter("hydra", model=model, tokenizer=tokenizer)


def test_copy_first_forms_are_derived_for_model_drafters():
    kinds = registry.drafter_kinds()
    models = [k.name for k in registry.model_drafters()]
    assert list(kinds) == [*registry._REGISTERED, *(f"{m}+lookup" for m in models),
                           *(f"{m}+suffix" for m in models)]
    for m in models:
        for copier in ("lookup", "suffix"):
            combined = kinds[f"{m}+{copier}"]
            assert (combined.model_name, combined.options, combined.checkpoint) == (
                m, kinds[m].options + kinds[copier].options, kinds[m].checkpoint)
    for name in ("lookup+lookup", "none+lookup", "suffix+lookup", "lookup+suffix"):
        assert name not in kinds  # no checkpoint, no form


def test_a_copy_first_form_takes_its_copier_s_options_and_its_model_s(tiny, checkpoints):
    from mlxspec.drafters.suffix import SuffixDrafter

    model, tokenizer = tiny
    drafter = mlxspec.load_drafter("dflash+suffix", checkpoints["dflash"], model=model,
                                   tokenizer=tokenizer, depth=8, min_prob=0.3, tree=True,
                                   block_size=2)
    assert isinstance(drafter.copier, SuffixDrafter)
    assert (drafter.copier.depth, drafter.copier.min_prob, drafter.drafts_trees) == (8, 0.3, True)
    assert drafter.model_drafter.name == "dflash" and drafter.model_drafter.max_draft == 1
    assert drafter.remembers and drafter.fork().copier.history is drafter.copier.history
    lookup = mlxspec.load_drafter("draft+lookup", checkpoints["draft"], model=model,
                                  tokenizer=tokenizer, branches=3)
    assert lookup.copier.branches == 3 and not lookup.remembers
    r = invoke("generate", "--model", str(checkpoints["draft"]), "--drafter", "draft+lookup",
               "--draft-model", str(checkpoints["draft"]), "--suffix-depth", "8", "--prompt", "hi")
    assert r.exit_code != 0 and "only applies to --drafter suffix" in r.output


def test_a_server_offers_each_copier_in_front_of_its_model_drafter(tiny, checkpoints):
    """`serve --drafter draft+suffix --suffix-depth 8`: requests may name suffix, lookup, draft
    and both its copy-first forms; the suffix copier is the server's one suffix drafter, with
    the options given, so every request drafting from replies shares one history."""
    from test_server import Running
    from test_server_batching import ask

    from mlxspec.server import make_server

    model, tokenizer = tiny
    server = make_server(model, tokenizer, drafter="draft+suffix", model_id="tiny",
                         draft_model=str(checkpoints["draft"]), depth=8)
    running = Running(server)
    try:
        for name in ("draft+suffix", "suffix", "draft+lookup", "draft"):
            reply = ask(running, {"prompt": "one two three", "max_tokens": 4, "temperature": 0,
                                  "drafter": name})
            assert reply["usage"]["mlxspec"]["drafter"] == name
        drafters = server.worker.drafters
        assert set(drafters) == {"none", "lookup", "suffix", "draft", "draft+lookup",
                                 "draft+suffix"}
        assert drafters["draft+suffix"].copier is drafters["suffix"]
        assert drafters["suffix"].depth == 8 and len(drafters["suffix"].history.replies) == 2
        assert drafters["draft+lookup"].copier is drafters["lookup"]
        assert drafters["draft+lookup"].model_drafter is drafters["draft"]
    finally:
        running.stop()


def test_missing_checkpoint_message_names_the_model_drafter(tiny):
    model, tokenizer = tiny
    for name in ("draft", "draft+lookup"):
        with pytest.raises(ValueError, match=r"^the draft drafter needs a draft model path "
                                             r"\(--draft-model\)$"):
            mlxspec.load_drafter(name, model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="the dflash drafter needs a drafter checkpoint trained "
                                         "for this target .*ships one only"):
        mlxspec.load_drafter("dflash+lookup", model=model, tokenizer=tokenizer)


def test_refuses_a_bad_or_taken_name():
    for name in ("dflash", "a+b", "k@4", ""):
        with pytest.raises(ValueError, match="already registered|letters, digits"):
            registry.register(DrafterKind(name, host_only(Drafter)))
    with pytest.raises(ValueError, match="unknown backends"):
        registry.register(DrafterKind("toy", {"jax": lambda *a, **k: Drafter()}))
    assert "toy" not in registry.drafter_names()


# ---- A new drafter: one class and one entry --------------------------------------------------


class RepeatLastDrafter(Drafter):
    """Guesses that the last token repeats: wrong mostly, but it drafts every step."""

    name = "repeat"
    default_num_draft = 2

    def __init__(self, times: int = 1):
        self.times = times

    def propose(self, tokens, k, sampling):
        return Draft(tokens=[tokens[-1]] * min(k, self.times))


@pytest.fixture
def repeat_registered():
    registry.register(DrafterKind("repeat", host_only(RepeatLastDrafter)))
    try:
        yield
    finally:
        registry.unregister("repeat")


def test_a_registered_drafter_runs_through_the_api(tiny, repeat_registered):
    model, tokenizer = tiny
    plain = list(mlxspec.stream_generate(model, tokenizer, PROMPT, 12))
    spec = list(mlxspec.stream_generate(model, tokenizer, PROMPT, 12, drafter="repeat"))
    assert [r.token for r in spec] == [r.token for r in plain]
    assert spec[-1].drafter == "repeat" and spec[-1].drafted > 0
    built = mlxspec.load_drafter("repeat", model=model, tokenizer=tokenizer, times=2)
    assert isinstance(built, RepeatLastDrafter) and built.times == 2


def test_a_registered_drafter_runs_from_the_cli(tiny_dir, repeat_registered):
    args = ["generate", "--model", str(tiny_dir), "--prompt", PROMPT, "-n", "12", "-v"]
    plain = invoke(*args)
    spec = invoke(*args, "--drafter", "repeat")
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    assert "Drafter: repeat (up to 2 drafts per step)" in spec.stderr
    refused = invoke(*args, "--drafter", "repeat", "--full-vocab")
    assert refused.exit_code == 2 and "--full-vocab: only applies to --drafter dflash" in (
        refused.stderr)


def test_an_unregistered_drafter_is_refused_again(tiny_dir):
    result = invoke("generate", "--model", str(tiny_dir), "--prompt", "hi", "--drafter", "repeat")
    assert result.exit_code == 2 and "'repeat' is not one of 'none'" in result.stderr


def test_a_registered_model_drafter_gets_its_copy_first_forms_and_flags(tiny, tiny_dir):
    """A drafter with a checkpoint: its +lookup and +suffix forms, the checkpoint required by
    the CLI when nothing ships, and the path handed to its factory."""
    model, tokenizer = tiny
    seen = []

    def build(path, *, model, tokenizer, **options):
        seen.append(path)
        return RepeatLastDrafter(**options)

    registry.register(DrafterKind("toy", {"mlx": build},
                                  checkpoint=registry.Checkpoint("a toy checkpoint")))
    try:
        names = registry.drafter_names()
        assert names[-1] == "toy+suffix" and "toy+lookup" in names
        drafter = mlxspec.load_drafter("toy+lookup", tiny_dir, model=model, tokenizer=tokenizer)
        assert drafter.name == "repeat+lookup" and seen == [tiny_dir]
        drafter = mlxspec.load_drafter("toy+suffix", tiny_dir, model=model, tokenizer=tokenizer)
        assert drafter.name == "repeat+suffix" and seen == [tiny_dir, tiny_dir]
        with pytest.raises(ValueError, match=r"the toy drafter needs a toy checkpoint"):
            mlxspec.load_drafter("toy+lookup", model=model, tokenizer=tokenizer)
        result = invoke("generate", "--prompt", "hi", "--drafter", "toy+lookup")
        assert result.exit_code == 2 and "--drafter toy+lookup needs --draft-model" in result.stderr
    finally:
        registry.unregister("toy")
    assert not {"toy+lookup", "toy+suffix"} & set(registry.drafter_names())


# ---- The MLX path imports no torch ----------------------------------------------------------

NO_TORCH = """
import sys
from pathlib import Path
sys.modules["torch"] = None  # as if not installed: any import of it fails
sys.path.insert(0, sys.argv[2])

import mlxspec
from tiny_models import tiny_llama

from mlx_lm.utils import load_tokenizer

model, tokenizer = tiny_llama(vocab=49152), load_tokenizer(Path(sys.argv[1]))
for name in ("none", "lookup"):
    drafter = mlxspec.load_drafter(name, model=model, tokenizer=tokenizer)
    text = mlxspec.generate(model, tokenizer, [1, 2, 3, 1, 2], max_tokens=4, drafter=drafter)
print(sorted(m for m in sys.modules if m.startswith("mlxspec.backends.torch")))
"""


def test_the_mlx_path_imports_no_torch(smollm_dir):
    """torch hidden (it is installed here; mlx-lm's transformers would import it otherwise):
    mlxspec, the registry and a lookup drafter generating on MLX never reach for it."""
    tests = str(Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, str(smollm_dir), tests],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("label, parsed", [
    ("dflash", ("dflash", {})),
    ("dflash:tree-budget=16@15", ("dflash", {"tree_budget": 16})),
    ("dflash:full-vocab:tree-width=2", ("dflash", {"draft_vocab": False, "tree_width": 2})),
    ("lookup:lookup-branches=3", ("lookup", {"branches": 3})),
    ("dflash+lookup:block-size=8@4", ("dflash+lookup", {"block_size": 8})),
    ("dflash+suffix:suffix-tree:block-size=8", ("dflash+suffix", {"tree": True, "block_size": 8})),
    ("draft+lookup:lookup-branches=2", ("draft+lookup", {"branches": 2})),
])
def test_bench_labels_carry_a_drafters_own_options(label, parsed):
    assert registry.parse_label(label) == parsed


@pytest.mark.parametrize("label, words", [
    ("lookup:tree-budget=4", "lookup takes no option 'tree-budget' (lookup-branches)"),
    ("dflash:tree-budget", "write tree-budget=VALUE"),
    ("dflash:full-vocab=1", "write full-vocab"),
    ("dflash:tree-budget=x", "tree-budget takes a int, got 'x'"),
    ("dflash:tree-budget=0", "--tree-budget must be >= 1, got 0"),
    ("nope:x=1", "unknown drafter 'nope'"),
])
def test_bad_bench_labels_are_refused_naming_the_label(label, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        registry.parse_label(label)
