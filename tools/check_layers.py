#!/usr/bin/env python3
"""Checks that amp8's folders include only from the layers below them (docs/design.md, "Layers"):

    ops/ < plugin/compat/ < plugin/fp8/ < plugin/modules/ < plugin/optim/ < plugin/distributed/
        < plugin/precision/ < plugin/training/ < recipes/ < recipes/data/ < recipes/llama/ < recipes/gpt/
        < recipes/gpt_pretrain.cc (the binary's main)

A source may include its own folder and any folder earlier in LAYERS (plugin/optim/ does not
need plugin/modules/, but may). Exits 1, naming each include that points up.
Usage: check_layers.py [ROOT]
"""
import pathlib
import re
import sys

LAYERS = ["ops", "plugin/compat", "plugin/fp8", "plugin/modules", "plugin/optim",
          "plugin/distributed", "plugin/precision", "plugin/training", "recipes", "recipes/data",
          "recipes/llama", "recipes/gpt", "recipes/gpt_pretrain.cc"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_of(path):
    """The deepest LAYERS entry that `path` (relative, with /) lies under, or None."""
    best = None
    for index, layer in enumerate(LAYERS):
        if path == layer or path.startswith(layer + "/"):
            if best is None or len(layer) > len(LAYERS[best]):
                best = index
    return best


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent)
    problems, checked = [], 0
    for top in ("ops", "plugin", "recipes"):
        for source in sorted((root / top).rglob("*")):
            if source.suffix not in (".h", ".cc", ".cu", ".cuh"):
                continue
            relative = source.relative_to(root).as_posix()
            own = layer_of(relative)
            checked += 1
            for included in INCLUDE.findall(source.read_text()):
                target = layer_of(included)
                if target is not None and own is not None and target > own:
                    problems.append(f"{relative} includes {included}: {LAYERS[target]}/ is above "
                                    f"{LAYERS[own]}/ in the layering")
    for problem in problems:
        print(problem)
    print(f"check_layers: {checked} sources, {len(problems)} include(s) pointing up")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
