"""Find bertviz views in HTML: each view is a div with a random id plus a script holding its data.

tfcore.viz writes each view's data deflated (``tfcoreViz.json("<base64>", n)``); bertviz's own
HTML holds it as a JSON object. Both are read.
"""

from __future__ import annotations

import json
import re

from tfcore.viz import _inflate

_DATA = r'(\{.*?\}|tfcoreViz\.json\("([A-Za-z0-9+/=]+)", \d+\))'
_HEAD_OR_MODEL = re.compile(r"const params = " + _DATA + r";? *(?:// HACK|\n)", re.DOTALL)
_NEURON = re.compile(r"window\.bertviz_params = " + _DATA + r";?\s*\n?</script>", re.DOTALL)
_DIV = re.compile(r"<div id=['\"]?(bertviz-[0-9a-f]{32})")


def views(html: str) -> list[dict]:
    """The params of every bertviz view in ``html``, each with its ``kind`` and ``root_div_id``.

    A view counts only if its container div is in the page too.
    """
    divs = set(_DIV.findall(html))
    found = []
    for pattern, kind in ((_HEAD_OR_MODEL, None), (_NEURON, "neuron")):
        for match in pattern.finditer(html):
            params = json.loads(_inflate(match.group(2)) if match.group(2) else match.group(1))
            if params["root_div_id"] not in divs:
                continue
            params["kind"] = kind or ("model" if "display_mode" in params else "head")
            found.append(params)
    return found
