"""Fetch the JavaScript the book serves itself, from the npm registry, with its licences.

    python tools/vendor_js.py

The results are committed (so that building and testing need no network):
- tfcore/vendor/: require.js, d3 and jQuery, which tfcore.viz puts (deflated) into every bertviz
  view so that the views draw in Jupyter and on Colab without a CDN, and which the book serves
  once per site; tiny-inflate, which inflates them (and each view's data) in the browser;
- book/_vendor/mathjax/: MathJax 3 (tex-mml-chtml and its fonts), served by the book.

Each tarball is checked against the integrity hash the registry published for that version.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PACKAGES = {
    "requirejs@2.3.6": ("sha512-ipEzlWQe6RK3jkzikgCupiTbTvm4S0/CAU5GlgptkN5SO6F3u0UD0K18wy6ErDqiCyP4J4YYe1HuAShvsxePLg==",
                        {"package/require.js": "tfcore/vendor/require.js"}),
    "d3@5.7.0": ("sha512-8KEIfx+dFm8PlbJN9PI0suazrZ41QcaAufsKE9PRcqYPWLngHIyWJZX96n6IQKePGgeSu0l7rtlueSSNq8Zc3g==",
                 {"package/dist/d3.min.js": "tfcore/vendor/d3.min.js",
                  "package/LICENSE": "tfcore/vendor/LICENSE.d3"}),
    # bertviz asks for jQuery 2.0.0, which is not on npm; 2.1.0 is the nearest release there.
    "jquery@2.1.0": ("sha512-QyJAvw0LUlUPci88C5LTFNtg4WFs70Dkqmwq4rZyOBflduKnHZakpIIDjhZVygAQbUqaghv6msUyP5TmRoNevQ==",
                     {"package/dist/jquery.min.js": "tfcore/vendor/jquery.min.js",
                      "package/MIT-LICENSE.txt": "tfcore/vendor/LICENSE.jquery"}),
    # A 9 KB inflater: tfcore.viz ships the three libraries above, and each view's data, deflated.
    "tiny-inflate@1.0.3": ("sha512-pkY1fj1cKHb2seWDy0B16HeWyczlJA9/WW3u3c4z/NiWDsO3DOU5D7nhTLE9CF0yXv/QZFY7sEJmj24dK+Rrqw==",
                           {"package/index.js": "tfcore/vendor/tiny-inflate.js",
                            "package/LICENSE": "tfcore/vendor/LICENSE.tiny-inflate"}),
    "mathjax@3.2.2": ("sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw==",
                      {"package/es5/tex-mml-chtml.js": "book/_vendor/mathjax/tex-mml-chtml.js",
                       "package/es5/output/chtml/fonts/woff-v2/": "book/_vendor/mathjax/output/chtml/fonts/woff-v2/",
                       "package/LICENSE": "book/_vendor/mathjax/LICENSE"}),
}

REQUIREJS_LICENSE = """RequireJS 2.3.6, Copyright jQuery Foundation and other contributors.
Released under the MIT license (see the header of require.js and
https://github.com/requirejs/requirejs/blob/master/LICENSE).
"""


def fetch(spec: str, integrity: str, folder: Path) -> Path:
    name = subprocess.run(["npm", "pack", spec, "--silent"], cwd=folder, check=True,
                          capture_output=True, text=True).stdout.strip().splitlines()[-1]
    tarball = folder / name
    algorithm, expected = integrity.split("-", 1)
    actual = base64.b64encode(hashlib.new(algorithm, tarball.read_bytes()).digest()).decode()
    if actual != expected:
        raise SystemExit(f"{spec}: integrity mismatch ({actual} != {expected})")
    return tarball


def main() -> None:
    for target in ("tfcore/vendor", "book/_vendor"):
        shutil.rmtree(ROOT / target, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        for spec, (integrity, files) in PACKAGES.items():
            with tarfile.open(fetch(spec, integrity, Path(tmp))) as archive:
                for member in archive.getmembers():
                    for source, target in files.items():
                        if member.isfile() and (member.name == source or
                                                (source.endswith("/") and member.name.startswith(source))):
                            destination = ROOT / (target + member.name[len(source):] if source.endswith("/") else target)
                            destination.parent.mkdir(parents=True, exist_ok=True)
                            destination.write_bytes(archive.extractfile(member).read())
            print(f"{spec}: ok")
    (ROOT / "tfcore/vendor/LICENSE.requirejs").write_text(REQUIREJS_LICENSE)


if __name__ == "__main__":
    main()
