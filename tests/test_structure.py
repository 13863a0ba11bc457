"""The op structure of a composed set: each op's children split by the fewest switches that fix them, so an entry
covers every combination of the other switches; a config no entry matches takes the nearest entry's children and is
reported as extrapolated."""
from types import SimpleNamespace

from estimator import formulas as F
from estimator.compose import ComposedCache
from fit.programs.switches import fit_structure

LOCAL = ["layers.*.input_layernorm", "layers.*.self_attention", "layers.*.pre_mlp_layernorm", "layers.*.mlp"]
TE = ["layers.*.self_attention", "layers.*.mlp"]


def run(spec, moe, recompute):
    mlp = ["layers.*.mlp.router", "layers.*.mlp.experts"] if moe else ["layers.*.mlp.linear_fc1",
                                                                       "layers.*.mlp.linear_fc2"]
    return SimpleNamespace(switches={"spec": spec, "moe": moe, "recompute": recompute, "attention": "flash"},
                           children={"layers.*": TE if spec == "te" else LOCAL, "layers.*.mlp": mlp})


def test_children_split_by_the_fewest_switches_that_fix_them():
    # The layer spec fixes a layer's children and MoE the MLP's: MoE was traced with the local spec only, and
    # recompute varies too, yet each op's entries name one switch, so TE + MoE has both.
    runs = [run("local", False, "none"), run("te", False, "none"), run("local", True, "none"),
            run("local", False, "selective"), run("te", False, "selective")]
    entries = {(e["op"], tuple(sorted(e["when"].items()))): e["children"] for e in fit_structure(runs)}
    assert entries == {
        ("layers.*", (("spec", "local"),)): LOCAL, ("layers.*", (("spec", "te"),)): TE,
        ("layers.*.mlp", (("moe", False),)): ["layers.*.mlp.linear_fc1", "layers.*.mlp.linear_fc2"],
        ("layers.*.mlp", (("moe", True),)): ["layers.*.mlp.router", "layers.*.mlp.experts"]}


def _set(structure):
    return F.from_dict({"format": F.FORMAT, "version": F.COMPOSED_VERSION, "name": "t", "kind": "fitted",
                        "composed": True, "formulas": [],
                        "segments": [{"label": "layers.*", "when": {}, "seen": {}, "fwd_delta": [], "fwd_peak": [],
                                      "bwd_delta": [], "bwd_peak": []}], "structure": structure})


def test_a_config_no_entry_matches_takes_the_nearest_and_says_so():
    fset = _set([{"op": "layers.*", "when": {"spec": "local", "moe": False}, "children": LOCAL},
                 {"op": "layers.*", "when": {"spec": "te", "moe": False}, "children": TE}])
    cache = ComposedCache.__new__(ComposedCache)
    cache.fset, cache.extrapolated = fset, set()
    assert list(cache.children("layers.*", {"spec": "te", "moe": False})) == TE
    assert cache.extrapolated == set()
    got = cache.children("layers.*", {"spec": "te", "moe": True})     # never traced: nearest is TE dense
    assert list(got) == TE and cache.extrapolated == {"layers.* (children)"}
