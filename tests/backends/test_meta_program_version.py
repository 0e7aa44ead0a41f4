"""A bundle whose metadata kernels cannot read the program this runtime encodes is refused, before
any launch, with what to do: another version of the program (the kernels' scratch_words says -2),
or more sets, OUT sets, experts or top-k than the bundle was built for (-1, which a bundle compiled
before -2 existed also says for another version).  The library is a stand-in: only its answers
matter here, the program and the plan are a shipped plan's."""

from __future__ import annotations

import pytest
import torch
from test_meta_kernels import _manifest, _routing

from epcc.backends.cuda.meta_program import VERSION
from epcc.plan.segments import segment_program
from epcc.runtime.engines.base import EngineError
from epcc.runtime.engines.cuda_table import meta


class _Lib:
    """Every entry point answers 0 but those a test sets (argtypes and restype may be assigned)."""

    def __init__(self, **answers):
        self.answers = {"epcc_table_meta_abi": meta.META_ABI, "epcc_table_meta_timeline_words": meta.TIMELINE_WORDS,
                        "epcc_table_meta_error": b"", **answers}

    def __getattr__(self, name):
        answer = self.answers.get(name, 0)

        def entry(*_args):
            return answer

        setattr(self, name, entry)
        return entry


def _device_meta(words: int):
    plan, _, _, _ = _routing("h200x2_2vnode", 40, 3, 1)
    manifest = _manifest(plan, "h200x2_2vnode", 40, 3)
    lib = _Lib(epcc_table_meta_scratch_words=words)
    return meta.DeviceMeta(lib, manifest, plan, segment_program(plan), 0, torch.device("cpu"), 1.0)


def test_kernels_of_another_program_version_are_refused_by_name():
    with pytest.raises(EngineError) as e:
        _device_meta(-2)
    assert str(e.value) == (f"the bundle's metadata kernels read another version of the metadata program than this "
                            f"epcc writes (version {VERSION}): recompile the bundle with this epcc")


def test_kernels_built_for_fewer_sets_are_refused_with_both_capacities():
    with pytest.raises(EngineError) as e:
        _device_meta(-1)
    text = str(e.value)
    assert text.startswith("the bundle's metadata kernels do not hold rank 0's program (built for {")
    assert "it needs Capacity(" in text and text.endswith(
        "or compiled by another epcc, whose metadata program differs): recompile the bundle with this epcc")
