"""Find bertviz views in HTML: each view is a div with a random id plus a script holding its data."""

from __future__ import annotations

import json
import re

_HEAD_OR_MODEL = re.compile(r"const params = (\{.*?\}); // HACK", re.DOTALL)
_NEURON = re.compile(r"window\.bertviz_params = (\{.*?\})\s*\n?</script>", re.DOTALL)
_DIV = re.compile(r"<div id=['\"]?(bertviz-[0-9a-f]{32})")


def views(html: str) -> list[dict]:
    """The params of every bertviz view in ``html``, each with its ``kind`` and ``root_div_id``.

    A view counts only if its container div is in the page too.
    """
    divs = set(_DIV.findall(html))
    found = []
    for pattern, kind in ((_HEAD_OR_MODEL, None), (_NEURON, "neuron")):
        for match in pattern.finditer(html):
            params = json.loads(match.group(1))
            if params["root_div_id"] not in divs:
                continue
            params["kind"] = kind or ("model" if "display_mode" in params else "head")
            found.append(params)
    return found
