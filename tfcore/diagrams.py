"""Schematic diagrams drawn by code: attention, the split into heads, encoder and decoder layers.

Chapters 2, 4, 5 and 9 draw these with the sizes of their own tensors, so that a label cannot
drift from the code. Each function returns a ``Diagram``, a matplotlib ``Figure`` that a notebook
cell ending with it shows as a PNG, and draws the same picture on every run: no randomness, no data.

- ``attention_diagram(batch, len_q, len_k, d_k, d_v)``: scaled dot-product attention, each
  tensor a box with its shape, each operation on its arrow (chapter 2);
- ``heads_diagram(batch, length, hidden, heads)``: the fused multi-head layer's ``view`` and
  ``transpose``, with the hidden axis cut into one coloured slice per head (chapter 4);
- ``layer_diagram(kind, norm_first)``: an encoder or a decoder layer with its residual adds and
  its layer norms, pre-LN or post-LN, side by side when given both (chapters 5 and 9); with
  ``embeddings=True``, the whole encoder (chapter 6);
- ``encoder_decoder_diagram(source, target)``: the whole pre-LN encoder-decoder (chapter 9);
- ``decoder_only_diagram(kinds)``: GPT-2's and Llama's decoder-only models side by side
  (chapters 12 and 16; with ``changes=True`` the four changes numbered);
- ``hybrid_diagram(config)``: Qwen3.5's hybrid stack and one Gated DeltaNet layer, with the sizes
  of a ``tfcore.hybrid.Qwen35Config`` (chapter 20).

Every text artist carries a ``gid`` saying what it labels (``"tensor:scores"``,
``"op:softmax"``, ``"norm"``, ``"sublayer"``, ``"add"``, ``"head:3"``, ...), so that a test can
find it. matplotlib is imported here only: ``import tfcore`` does not need it.
"""

from __future__ import annotations

import io
import operator
from dataclasses import dataclass

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyBboxPatch, Rectangle

from .hybrid import FULL, LINEAR, GatedDeltaNet, Qwen35Config

FONT = 9        # points, every label
SMALL = 8       # points, module names and notes: the smallest text drawn
SCALE = 0.6     # inches per drawing unit, the same along both axes (so that circles stay round)
COLOURS = {"tensor": "#eef3fb", "norm": "#fce5cd", "attention": "#cfe2f3", "cross": "#f4cccc",
           "feed_forward": "#d9ead3", "embedding": "#eeeeee", "memory": "#fff2cc", "mask": "#ffffff"}


# ----------------------------------------------------------------------------- shared helpers

def _positive_ints(**values) -> None:
    for name, value in values.items():
        try:
            ok = not isinstance(value, bool) and operator.index(value) >= 1
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _shape(*sizes) -> str:
    return "[" + ", ".join(str(s) for s in sizes) + "]"


class Diagram(Figure):
    """A matplotlib ``Figure`` that Jupyter shows as a PNG when a cell ends with it.

    It is made without pyplot, so that drawing one never shows it twice nor leaves it open; where
    matplotlib's own inline display is active, that display is used instead, and it is the same.
    """

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", bbox_inches="tight")
        return buffer.getvalue()


def _canvas(width: float, height: float):
    """A figure of ``width`` x ``height`` drawing units, one axes covering it, no frame or ticks."""
    fig = Diagram(figsize=(width * SCALE, height * SCALE))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax


def _fit(fig, ax, width: float, height: float, scale: float = SCALE) -> None:
    """Resize a canvas to ``width`` x ``height`` units once its drawing is known (``scale``: inches
    per unit, the same along both axes)."""
    fig.set_size_inches(round(width * scale, 2), round(height * scale, 2))  # whole pixels at 100 dpi
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)


@dataclass(frozen=True)
class _Box:
    x: float  # centre
    y: float
    w: float
    h: float

    @property
    def top(self):
        return self.x, self.y + self.h / 2

    @property
    def bottom(self):
        return self.x, self.y - self.h / 2

    @property
    def left(self):
        return self.x - self.w / 2, self.y

    @property
    def right(self):
        return self.x + self.w / 2, self.y


def _box(ax, x, y, w, h, text, role, colour, *, name=None, dashed=False, fontsize=FONT) -> _Box:
    """A rounded box centred on (x, y) with ``text``; ``name`` (a module's attribute) below it."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.08",
                                facecolor=colour, edgecolor="black", linewidth=1,
                                linestyle="--" if dashed else "-", gid=role))
    if name is None:
        ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, gid=role)
    else:
        ax.text(x, y + 0.1, text, ha="center", va="center", fontsize=fontsize, gid=role)
        ax.text(x, y - 0.14, name, ha="center", va="center", fontsize=SMALL, family="monospace", gid="name")
    return _Box(x, y, w, h)


def _arrow(ax, start, end, label=None, *, where="right", role="op", dashed=False, colour="black",
           fontsize=SMALL + 0.5, rad=0.0, at=0.5):
    """An arrow from ``start`` to ``end``; ``label`` (the operation) beside it, ``at`` of the way along."""
    ax.annotate("", xy=end, xytext=start,
                arrowprops=dict(arrowstyle="-|>", color=colour, lw=1.2, shrinkA=0, shrinkB=0,
                                linestyle="--" if dashed else "-", connectionstyle=f"arc3,rad={rad}"))
    if label:
        mx, my = start[0] + at * (end[0] - start[0]), start[1] + at * (end[1] - start[1])
        dx, dy, ha, va = {"right": (0.12, 0, "left", "center"), "left": (-0.12, 0, "right", "center"),
                          "above": (0, 0.08, "center", "bottom"), "below": (0, -0.08, "center", "top")}[where]
        ax.text(mx + dx, my + dy, label, ha=ha, va=va, fontsize=fontsize, color=colour, gid=role)


def _add(ax, x, y, r=0.17):
    """A residual add: a circle with a plus."""
    ax.add_patch(Circle((x, y), r, facecolor="white", edgecolor="black", linewidth=1.2, gid="add"))
    ax.text(x, y, "+", ha="center", va="center", fontsize=FONT + 3, gid="add")


# ----------------------------------------------------------------------------- attention

def attention_diagram(batch: int, len_q: int, len_k: int, d_k: int, d_v: int) -> Diagram:
    """Scaled dot-product attention, softmax(Q Kᵀ / √d_k) V, with the shape of every tensor.

    Boxes are tensors (``[B, Lq, dk]`` and the numbers given), arrows are operations: K is
    transposed, ``bmm`` with Q gives the scores ``[B, Lq, Lk]``, they are divided by √d_k, an
    optional mask (chapter 3) blocks some of them, a softmax over the last axis (the keys) gives
    the weights, and ``bmm`` with V gives the output ``[B, Lq, dv]``. (``tfcore``'s function
    divides the queries instead of the scores: the same numbers, for fewer divisions.)
    """
    _positive_ints(batch=batch, len_q=len_q, len_k=len_k, d_k=d_k, d_v=d_v)
    # narrow enough to be read at a book's text column (about 760 px): the columns close together,
    # the long labels on two lines
    fig, ax = _canvas(14.6, 8.8)
    w, h = 2.4, 1.15

    def tensor(x, y, title, symbols, sizes, role):
        return _box(ax, x, y, w, h, f"{title}\n{_shape(*symbols)}\n{_shape(*sizes)}", role, COLOURS["tensor"])

    q = tensor(1.3, 6.9, "Q (queries)", ("B", "Lq", "dk"), (batch, len_q, d_k), "tensor:Q")
    k = tensor(1.3, 4.4, "K (keys)", ("B", "Lk", "dk"), (batch, len_k, d_k), "tensor:K")
    v = tensor(1.3, 1.0, "V (values)", ("B", "Lk", "dv"), (batch, len_k, d_v), "tensor:V")
    kt = tensor(5.6, 4.4, "Kᵀ", ("B", "dk", "Lk"), (batch, d_k, len_k), "tensor:K^T")
    scores = tensor(8.6, 6.9, "scores", ("B", "Lq", "Lk"), (batch, len_q, len_k), "tensor:scores")
    scaled = tensor(12.6, 6.9, "scaled scores", ("B", "Lq", "Lk"), (batch, len_q, len_k), "tensor:scaled")
    weights = tensor(12.6, 3.3, "weights", ("B", "Lq", "Lk"), (batch, len_q, len_k), "tensor:weights")
    output = tensor(12.6, 1.0, "output", ("B", "Lq", "dv"), (batch, len_q, d_v), "tensor:output")

    _arrow(ax, k.right, kt.left, "transpose(1, 2)", where="above", role="op:transpose")
    _arrow(ax, q.right, scores.left, "bmm(Q, Kᵀ): the dot product\nof every query with every key",
           where="above", role="op:bmm")
    _arrow(ax, kt.right, (scores.left[0], scores.y - 0.35))
    _arrow(ax, scores.right, scaled.left, f"÷ √dk\n= ÷ √{d_k}", where="above", role="op:scale")
    mask = _box(ax, 9.35, 5.15, 3.6, 1.0, f"mask {_shape('B', 'Lq', 'Lk')}\n(optional, chapter 3):\n"
                "blocked scores → very negative", "mask", COLOURS["mask"], dashed=True)
    _arrow(ax, mask.right, (scaled.x - 0.04, mask.y), dashed=True, colour="dimgray")
    _arrow(ax, scaled.bottom, weights.top, "softmax(dim=-1):\neach row of Lk\nweights sums to 1",
           where="right", role="op:softmax", at=0.62)
    _arrow(ax, weights.bottom, output.top, "bmm(weights, V)", where="right", role="op:bmm")
    _arrow(ax, v.right, output.left, "V: one value per key; each output row is a weighted average of them",
           where="above", role="op:values")
    ax.text(7.3, 8.45, f"Scaled dot-product attention, softmax(QKᵀ / √dk) V,\nwith B = {batch}, "
            f"Lq = {len_q}, Lk = {len_k}, dk = {d_k}, dv = {d_v}", ha="center", va="center",
            fontsize=FONT + 1, gid="title")
    return fig


# ----------------------------------------------------------------------------- heads

def _head_colour(i: int, heads: int):
    """One colour per head (20 distinct ones, repeated beyond)."""
    return colormaps["tab20" if heads > 10 else "tab10"](i % 20)


def heads_diagram(batch: int, length: int, hidden: int, heads: int, tokens=None) -> Diagram:
    """The fused multi-head layer, ``[B, L, hidden]`` in and out, for the first batch item.

    Down the left: ``x``, the projection ``query(x)`` with its hidden axis cut into ``heads``
    coloured slices of ``head_dim = hidden // heads`` (one colour per head), ``.view(B, L, h, dh)``
    and ``.transpose(1, 2)``, which gathers each head's slices of every token into a block of its
    own. Across the bottom, attention in every head at once; up the right, the way back:
    ``transpose(1, 2)``, ``reshape(B, L, hidden)`` and ``output_linear``, which mixes the heads.
    At most 6 tokens are drawn; the labels give the real sizes. ``tokens`` names the rows.
    """
    _positive_ints(batch=batch, length=length, hidden=hidden, heads=heads)
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) is not divisible by heads ({heads}): every head must get "
                         f"hidden // heads numbers, so hidden must be a multiple of heads")
    if isinstance(tokens, str):
        raise ValueError(f"tokens must be a list of token strings, one per position, got the string "
                         f"{tokens!r}; split it first, e.g. {tokens!r}.split()")
    if tokens is not None and len(tokens) != length:
        raise ValueError(f"tokens must name the {length} positions, got {len(tokens)} names")
    head_dim, rows = hidden // heads, min(length, 6)
    names = [str(t) for t in tokens[:rows]] if tokens is not None else [f"token {i}" for i in range(rows)]
    # narrow enough to be read at a book's text column (about 760 px): each label on two lines
    pic_w, row_h = 4.2, 0.24
    pic_h = rows * row_h
    step = pic_h + 2.1  # from one picture's top to the next: two-line label, head numbers, arrow
    fig, ax = _canvas(14.0, 2.0 + 3 * step + 1.6)

    def rows_picture(x0, top, *, sliced, gap=0.0, mixed=False, stage):
        """L rows of ``hidden`` numbers; ``sliced``: coloured per head, ``gap``: split into cells."""
        seg = (pic_w - gap * (heads - 1)) / heads
        for r in range(rows):
            y = top - (r + 1) * row_h
            if not sliced:
                ax.add_patch(Rectangle((x0, y), pic_w, row_h * 0.85, facecolor="#b7b7b7" if not mixed else "#8e7cc3",
                                       edgecolor="white", linewidth=0.5, gid=f"{stage}:row"))
                continue
            for i in range(heads):
                ax.add_patch(Rectangle((x0 + i * (seg + gap), y), seg, row_h * 0.85, facecolor=_head_colour(i, heads),
                                       edgecolor="white", linewidth=0.3, gid=f"{stage}:slice:{i}"))
            if gap:
                ax.add_patch(Rectangle((x0 - 0.04, y - 0.02), pic_w + 0.08, row_h * 0.85 + 0.04, fill=False,
                                       edgecolor="black", linewidth=0.6))
        for r, name in enumerate(names):
            ax.text(x0 - 0.1, top - (r + 0.55) * row_h, name, ha="right", va="center", fontsize=SMALL, gid="token")

    def blocks_picture(x0, top, *, stage, hatch=None):
        """``heads`` blocks, each one head's L rows of ``head_dim`` numbers."""
        gap = 0.12
        seg = (pic_w - gap * (heads - 1)) / heads
        for i in range(heads):
            bx = x0 + i * (seg + gap)
            for r in range(rows):
                ax.add_patch(Rectangle((bx, top - (r + 1) * row_h), seg, row_h * 0.85, facecolor=_head_colour(i, heads),
                                       edgecolor="white", linewidth=0.3, hatch=hatch, gid=f"{stage}:slice:{i}"))
            ax.add_patch(Rectangle((bx - 0.03, top - pic_h - 0.03), seg + 0.06, pic_h + 0.03, fill=False,
                                   edgecolor="black", linewidth=0.6))
            head_number(bx + seg / 2, top, i)

    def head_number(x, top, i):
        """Head ``i``'s number above its slice or block (only the first and last beyond 16 heads)."""
        if heads <= 16 or i in (0, heads - 1):
            ax.text(x, top + 0.05, str(i), ha="center", va="bottom", fontsize=SMALL, gid=f"head:{i}")

    def label(x0, top, text, role):
        ax.text(x0, top + 0.33, text, ha="left", va="bottom", fontsize=FONT, gid=role)

    xl, xr = 1.0, 8.6
    tops = [2.0 + k * step for k in (3, 2, 1, 0)]
    # down the left: the split
    label(xl, tops[0], f"x: {_shape('B', 'L', 'hidden')}\n= {_shape(batch, length, hidden)}", "tensor:x")
    rows_picture(xl, tops[0], sliced=False, stage="x")
    label(xl, tops[1], f"q = query(x): {_shape('B', 'L', 'hidden')}\n= {_shape(batch, length, hidden)}, "
          f"{heads} slices of {head_dim}", "tensor:q")
    rows_picture(xl, tops[1], sliced=True, stage="q")
    for i in range(heads):
        head_number(xl + (i + 0.5) * pic_w / heads, tops[1], i)
    label(xl, tops[2], f".view(B, L, h, dh): {_shape('B', 'L', 'h', 'dh')}\n= {_shape(batch, length, heads, head_dim)}",
          "tensor:view")
    rows_picture(xl, tops[2], sliced=True, gap=0.09, stage="view")
    label(xl, tops[3], f".transpose(1, 2): {_shape('B', 'h', 'L', 'dh')}\n= {_shape(batch, heads, length, head_dim)}",
          "tensor:heads")
    blocks_picture(xl, tops[3], stage="heads")
    for a, b, text in [(0, 1, f"query: Linear({hidden}, {hidden});\nkey and value alike"),
                       (1, 2, f"the same numbers, the last\naxis read as {heads} × {head_dim}"),
                       (2, 3, "each head's slices of every\ntoken gathered in one block")]:
        _arrow(ax, (xl + pic_w / 2, tops[a] - pic_h - 0.1), (xl + pic_w / 2, tops[b] + 0.95), text,
               where="right", role="op")
    # across the bottom: attention, every head on its own
    _arrow(ax, (xl + pic_w + 0.2, tops[3] - pic_h / 2), (xr - 0.2, tops[3] - pic_h / 2),
           f"attention in\neach head at once:\nsoftmax(q kᵀ / √{head_dim}) v,\nweights {_shape(batch, heads, length, length)}",
           where="below", role="op:attention")
    # up the right: the way back
    label(xr, tops[3], f"context: {_shape('B', 'h', 'L', 'dh')}\n= {_shape(batch, heads, length, head_dim)}",
          "tensor:context")
    blocks_picture(xr, tops[3], stage="context", hatch="///")
    label(xr, tops[2], f".transpose(1, 2): {_shape('B', 'L', 'h', 'dh')}\n= {_shape(batch, length, heads, head_dim)}",
          "tensor:back")
    rows_picture(xr, tops[2], sliced=True, gap=0.09, stage="back")
    label(xr, tops[1], f".reshape(B, L, hidden): {_shape(batch, length, hidden)},\nheads side by side",
          "tensor:concat")
    rows_picture(xr, tops[1], sliced=True, stage="concat")
    label(xr, tops[0], f"output: {_shape('B', 'L', 'hidden')}\n= {_shape(batch, length, hidden)}", "tensor:output")
    rows_picture(xr, tops[0], sliced=False, mixed=True, stage="output")
    for a, b, text in [(3, 2, "every token's slices\nback in one row"),
                       (2, 1, "the h × dh numbers read\nas one axis again\n(reshape copies them;\nview would refuse)"),
                       (1, 0, f"output_linear:\nLinear({hidden}, {hidden})\nmixes the heads")]:
        _arrow(ax, (xr + pic_w / 2, tops[a] + 0.95), (xr + pic_w / 2, tops[b] - pic_h - 0.1), text,
               where="right", role="op")
    ax.text(7.0, tops[0] + 1.25, f"Multi-head attention, fused: {heads} heads of {head_dim} numbers "
            f"(first batch item{'' if rows == length else f', first {rows} of {length} tokens'})",
            ha="center", va="center", fontsize=FONT + 1, gid="title")
    return fig


# ----------------------------------------------------------------------------- layers

_SUBLAYERS = {
    "encoder": [("self-attention", "attention", "attention")],
    "decoder": [("masked self-attention", "self_attention", "attention"),
                ("cross-attention", "cross_attention", "cross")],
}
_BOX_W, _BOX_H, _GAP = 2.9, 0.5, 0.3


def _check_layer_args(kind, norm_first):
    if kind not in ("encoder", "decoder"):
        raise ValueError(f"kind must be 'encoder' or 'decoder', got {kind!r}")
    if not isinstance(norm_first, bool):
        raise ValueError(f"norm_first must be True (pre-LN) or False (post-LN), got {norm_first!r}")


def _draw_layer(ax, x, y, kind, norm_first, *, names=True, stack=True, small=SMALL):
    """Draw one layer upwards from (x, y), the top of its input; return a dict of anchor points.

    ``names``: the module attributes of tfcore's layer under each box (tfcore's decoder layer is
    pre-LN only, so a post-LN decoder gets none). ``stack``: a dashed frame, "× N", and, for
    pre-LN, the final LayerNorm that the stack applies once after its N layers. ``small``: the
    notes' font size (points).
    """
    names = names and (kind == "encoder" or norm_first)
    sublayers = _SUBLAYERS[kind] + [("feed-forward", "feed_forward", "feed_forward")]
    cursor, skip_x, anchors = y, x + _BOX_W / 2 + 0.35, {"bottom": (x, y)}
    first = None

    def box(text, role, colour, name):
        nonlocal cursor
        b = _box(ax, x, cursor + _GAP + _BOX_H / 2, _BOX_W, _BOX_H, text, role, colour,
                 name=name if names else None)
        _arrow(ax, (x, cursor), b.bottom)
        cursor = b.top[1]
        return b

    def add(branch_y, r=0.17):
        nonlocal cursor
        cy = cursor + _GAP + r
        _arrow(ax, (x, cursor), (x, cy - r))
        _add(ax, x, cy, r)
        ax.plot([x, skip_x, skip_x], [branch_y, branch_y, cy], color="black", lw=1.2)
        _arrow(ax, (skip_x, cy), (x + r, cy))
        cursor = cy + r
        return cy

    for i, (text, attribute, colour) in enumerate(sublayers, 1):
        branch_y = cursor + 0.2
        ax.plot([x, x], [cursor, branch_y], color="black", lw=1.2)
        ax.add_patch(Circle((x, branch_y), 0.05, color="black"))
        cursor = branch_y
        first = branch_y if first is None else first
        norm = ("LayerNorm", "norm", COLOURS["norm"], f"layer_norm_{i}")
        if norm_first:
            box(*norm)
        sub = box(text, "sublayer", COLOURS[colour], attribute)
        if attribute == "cross_attention":
            anchors["cross"] = sub.left
            ax.text(x - 0.08, sub.bottom[1] - 0.04, "queries", ha="right", va="top", fontsize=small, gid="note")
        add_y = add(branch_y)
        if not norm_first:
            b = box(*norm)
            ax.add_patch(Rectangle((x - _BOX_W / 2 - 0.12, add_y - 0.28), _BOX_W + 0.24, b.top[1] - add_y + 0.36,
                                   facecolor="#ececec", edgecolor="none", zorder=-1))
            ax.text(x - _BOX_W / 2 - 0.2, (add_y + b.y) / 2, "Add &\nNorm", ha="right", va="center",
                    fontsize=small, gid="add-norm")
    if stack:
        ax.add_patch(Rectangle((x - _BOX_W / 2 - 0.3, first - 0.1), _BOX_W + 1.05, cursor - first + 0.45,
                               fill=False, edgecolor="gray", linestyle="--"))
        ax.text(skip_x + 0.38, cursor + 0.17, "× N", ha="right", va="center", fontsize=FONT, color="gray",
                gid="stack")
        cursor += 0.35
        if norm_first:
            b = box("final LayerNorm", "final-norm", COLOURS["norm"], None)
            ax.text(b.left[0] - 0.1, b.y, "once, after\nthe N layers", ha="right", va="center", fontsize=small,
                    color="dimgray", gid="note")
    anchors["top"] = (x, cursor)
    return anchors


def layer_diagram(kind: str = "encoder", norm_first=True, *, shape=None, memory_shape=None,
                  embeddings: bool = False) -> Diagram:
    """An encoder or decoder layer, its sublayers, residual adds (+) and LayerNorms, drawn upwards.

    ``norm_first=True`` is pre-LN, tfcore's default: ``x = x + sublayer(LayerNorm(x))``, and a
    stack of such layers ends with one final LayerNorm; ``False`` is post-LN (BERT, the original
    paper): ``x = LayerNorm(x + sublayer(x))``, the paper's "Add & Norm". A sequence of bools, such
    as ``(True, False)``, draws one panel per arrangement, side by side. The module names under the
    boxes are those of ``tfcore.TransformerEncoderLayer`` / ``TransformerDecoderLayer``; the
    dropout on each sublayer's output is not drawn. ``shape`` and ``memory_shape`` (tuples) label
    the input and, for a decoder, the encoder's output. ``embeddings=True`` (encoder only) draws
    the whole ``tfcore.TransformerEncoder``: token ids in, its ``embeddings`` (with BERT's layer
    norm in the post-LN panel), the N layers and, pre-LN, the final LayerNorm.
    """
    arrangements = (norm_first,) if isinstance(norm_first, bool) else tuple(norm_first)
    if not arrangements:
        raise ValueError("norm_first must be True, False, or a non-empty sequence of them")
    for arrangement in arrangements:
        _check_layer_args(kind, arrangement)
    if not isinstance(embeddings, bool) or (embeddings and kind != "encoder"):
        raise ValueError(f"embeddings must be True or False, and True only for kind='encoder', got "
                         f"{embeddings!r} with kind={kind!r}")
    for name, given in (("shape", shape), ("memory_shape", memory_shape)):
        if given is not None and (isinstance(given, str) or not isinstance(given, (tuple, list))):
            raise ValueError(f"{name} must be a tuple of sizes, e.g. (2, 5, 384), got {given!r}")
    stream = _shape(*shape) if shape is not None else _shape("B", "L", "hidden")
    memory = _shape(*memory_shape) if memory_shape is not None else _shape("B", "Ls", "hidden")
    panel_w = 7.6 if kind == "decoder" else 5.4
    fig, ax = _canvas(panel_w * len(arrangements), 14)
    top = 0.0
    for p, arrangement in enumerate(arrangements):
        x = (p + 1) * panel_w - _BOX_W / 2 - 1.05
        start = 0.5
        if embeddings:
            ids = _shape(*shape[:2]) if shape is not None else _shape("B", "L")
            ax.text(x, 0.3, f"input_ids {ids}", ha="center", va="center", fontsize=FONT, gid="tensor:input")
            text = "token + position + type\nembeddings" + (", LayerNorm" if not arrangement else "")
            emb = _box(ax, x, 1.1, _BOX_W, 1.05, text, "embedding", COLOURS["embedding"])
            ax.texts[-1].set_y(1.24)
            ax.text(x, 0.78, "embeddings", ha="center", va="center", fontsize=SMALL, family="monospace",
                    gid="name")
            _arrow(ax, (x, 0.45), emb.bottom)
            start = emb.top[1]
        else:
            ax.text(x, 0.3, f"x {stream}", ha="center", va="center", fontsize=FONT, gid="tensor:input")
        anchors = _draw_layer(ax, x, start, kind, arrangement)
        _arrow(ax, anchors["top"], (x, anchors["top"][1] + 0.3))
        ax.text(x, anchors["top"][1] + 0.5, f"output {stream}", ha="center", va="center", fontsize=FONT,
                gid="tensor:output")
        top = max(top, anchors["top"][1] + 0.7)
        if kind == "decoder":
            cx, cy = anchors["cross"]
            m = _box(ax, cx - 2.25, cy, 1.5, 0.7, f"memory\n{memory}", "tensor:memory", COLOURS["memory"],
                     fontsize=SMALL)
            _arrow(ax, m.right, (cx, cy), "keys,\nvalues", where="above", colour="#cc0000", fontsize=SMALL)
    for p, arrangement in enumerate(arrangements):
        x = (p + 1) * panel_w - _BOX_W / 2 - 1.05
        where = "tfcore's default" if kind == "encoder" else "tfcore.TransformerDecoderLayer"
        title = f"pre-LN ({where})" if arrangement else "post-LN (BERT)" if embeddings else \
            "post-LN (BERT, original paper)" if kind == "encoder" else "post-LN (the original paper)"
        ax.text(x, top + 0.35, title, ha="center", va="center", fontsize=FONT + 1, gid="title")
    _fit(fig, ax, panel_w * len(arrangements), top + 0.7)
    return fig


def encoder_decoder_diagram(source, target, next_tokens=None) -> Diagram:
    """The pre-LN encoder-decoder of ``tfcore.make_model``, its layers drawn in full.

    ``source`` and ``target`` (lists of token strings) label the inputs; the memory is
    ``[B, len(source), d]``, the output ``[B, len(target), vocab]``. ``next_tokens``, if given,
    labels what each target position predicts.
    """
    for name, given in (("source", source), ("target", target), ("next_tokens", next_tokens)):
        if isinstance(given, str):
            raise ValueError(f"{name} must be a list of token strings, got the string {given!r}; split "
                             f"it first, e.g. {given!r}.split()")
    source, target = [str(t) for t in source], [str(t) for t in target]
    if not source or not target:
        raise ValueError("source and target must each hold at least one token")
    if next_tokens is not None and len(next_tokens) != len(target):
        raise ValueError(f"next_tokens must hold one token per target position ({len(target)}), "
                         f"got {len(next_tokens)}")
    width = 17.0
    fig, ax = _canvas(width, 14)
    enc_x, dec_x = 3.4, 11.4
    for x, tokens, what in [(enc_x, source, "source"), (dec_x, target, "target so far")]:
        ax.text(x, 0.3, f"{what}: {' '.join(tokens)}   ({len(tokens)} tokens)", ha="center", va="center",
                fontsize=FONT, gid=f"tensor:{what.split()[0]}")
        emb = _box(ax, x, 1.15, _BOX_W + 0.4, 0.75, "embedding × √d_model\n+ sinusoidal positions", "embedding",
                   COLOURS["embedding"])
        _arrow(ax, (x, 0.5), emb.bottom)
    note = SMALL + 1  # a wide drawing, read at a book's text column (about 760 px): larger notes
    enc = _draw_layer(ax, enc_x, 1.525, "encoder", True, names=False, small=note)
    dec = _draw_layer(ax, dec_x, 1.525, "decoder", True, names=False, small=note)
    memory = _box(ax, enc_x, enc["top"][1] + 0.75, 2.6, 0.6, f"memory  {_shape('B', len(source), 'd')}",
                  "tensor:memory", COLOURS["memory"])
    _arrow(ax, enc["top"], memory.bottom)
    cx, cy = dec["cross"]
    _arrow(ax, memory.right, (cx, cy), colour="#cc0000", rad=0.15)
    ax.text((memory.right[0] + cx) / 2 + 0.2, (memory.y + cy) / 2 + 0.25, "keys and values\nof every\n"
            "cross-attention", ha="left", va="center", fontsize=note, color="#cc0000", gid="note")
    gen = _box(ax, dec_x, dec["top"][1] + 0.7, _BOX_W, 0.7, "generator:\nLinear + log-softmax", "generator",
               COLOURS["embedding"])
    _arrow(ax, dec["top"], gen.bottom)
    out = f"log-probabilities {_shape('B', len(target), 'vocab')}"
    if next_tokens is not None:
        out += "\nnext tokens: " + " ".join(str(t) for t in next_tokens)
    out_y = gen.top[1] + 0.55
    ax.text(dec_x, out_y, out, ha="center", va="center", fontsize=FONT, gid="tensor:output")
    _arrow(ax, gen.top, (dec_x, gen.top[1] + 0.2))
    _arrow(ax, (dec_x + 2.3, out_y), (dec_x + 2.6, 0.45), dashed=True, colour="gray", rad=-0.2)
    ax.text(dec_x + 4.6, out_y / 2, "append the chosen token, run again", ha="center", va="center",
            fontsize=note, color="gray", rotation=90, gid="note")
    height = out_y + 0.9
    ax.text(width / 2, height - 0.3, "The encoder-decoder, pre-LN: each sublayer reads a LayerNorm of the "
            "stream and adds its output back (+)", ha="center", va="center", fontsize=FONT + 1, gid="title")
    _fit(fig, ax, width, height, scale=0.55)  # the tallest drawing: 7 inches at most
    return fig


# ----------------------------------------------------------------------------- decoder-only models

_DECODER_ONLY = {
    "gpt2": {
        "title": "GPT-2 (tfcore.GPT)", "norm": "LayerNorm", "final": "final_layer_norm",
        "embedding": ("token embeddings\n+ learned positions", "token_embeddings\nposition_embeddings"),
        "sublayers": [("layer_norm_1", "attention",
                       "masked self-attention:\nH heads of queries,\nkeys and values", "attention"),
                      ("layer_norm_2", "feed_forward",
                       "feed-forward:\nLinear(d, 4d), GELU,\nLinear(4d, d)", "feed_forward")],
        "head": "output layer, tied to\nthe token embeddings", "stack": "blocks"},
    "llama": {
        "title": "Llama (tfcore.Llama)", "norm": "RMSNorm", "final": "norm",
        "embedding": ("token embeddings\n(no positions)", "embed_tokens"),
        "sublayers": [("input_layernorm", "self_attn",
                       "masked self-attention:\nH query, H_kv key/value\nheads; RoPE on q and k", "attention"),
                      ("post_attention_layernorm", "mlp",
                       "SwiGLU:\ndown(silu(gate(x))\n* up(x))", "feed_forward")],
        "head": "output layer,\na matrix of its own", "stack": "layers",
        # the four changes from GPT-2's block, numbered on their boxes by ``changes=True``
        "changes": {"embedding": "2", "norm": "1", "attention": "2 4", "feed_forward": "3",
                    "final-norm": "1"}},
}
CHANGES = "changed from GPT-2: 1 RMSNorm, 2 RoPE (no position table), 3 SwiGLU, 4 GQA"
CHANGE_COLOUR = "#c00000"


def _mark(ax, box: _Box, numbers: str) -> None:
    """Numbered red badges on a box's right edge, one above the other, the first number on top."""
    numbers = numbers.split()
    for k, number in enumerate(numbers):
        x, y = box.x + box.w / 2 + 0.06, box.y + 0.21 * (len(numbers) - 1) - 0.42 * k
        ax.add_patch(Circle((x, y), 0.18, facecolor=CHANGE_COLOUR, edgecolor="white", zorder=3))
        ax.text(x, y, number, ha="center", va="center", fontsize=SMALL + 1, color="white",
                fontweight="bold", zorder=4, gid=f"change:{number}")


def _decoder_only_panel(ax, x, spec, box_w=3.0, gap=0.28, changes=False) -> float:
    """One decoder-only model drawn upwards around the boxes' centre ``x``; returns its top."""
    skip_x, name_x = x + box_w / 2 + 0.3, x - box_w / 2 - 0.3
    marks = spec.get("changes", {}) if changes else {}

    def name(y, text):
        ax.text(name_x, y, text, ha="right", va="center", fontsize=SMALL, family="monospace", gid="name")

    def box(cursor, height, text, role, colour, module=None, kind=None):
        b = _box(ax, x, cursor + gap + height / 2, box_w, height, text, role, colour)
        _arrow(ax, (x, cursor), b.bottom)
        if module:
            name(b.y, module)
        if (kind or role) in marks:
            _mark(ax, b, marks[kind or role])
        return b

    ax.text(x, 0.3, "token ids [B, L]", ha="center", va="center", fontsize=FONT, gid="tensor:input")
    embedding = box(0.45, 0.75, spec["embedding"][0], "embedding", COLOURS["embedding"], spec["embedding"][1])
    cursor = first = embedding.top[1] + 0.15
    ax.plot([x, x], [embedding.top[1], cursor], color="black", lw=1.2)
    for norm_name, sub_name, text, colour in spec["sublayers"]:
        branch_y = cursor + 0.15
        ax.plot([x, x], [cursor, branch_y], color="black", lw=1.2)
        ax.add_patch(Circle((x, branch_y), 0.05, color="black"))
        norm = box(branch_y, 0.45, spec["norm"], "norm", COLOURS["norm"], norm_name)
        sub = box(norm.top[1], 0.95, text, "sublayer", COLOURS[colour], sub_name, kind=colour)
        add_y = sub.top[1] + gap + 0.17
        _arrow(ax, sub.top, (x, add_y - 0.17))
        _add(ax, x, add_y)
        ax.plot([x, skip_x, skip_x], [branch_y, branch_y, add_y], color="black", lw=1.2)
        _arrow(ax, (skip_x, add_y), (x + 0.17, add_y))
        cursor = add_y + 0.17
    ax.add_patch(Rectangle((x - box_w / 2 - 0.15, first - 0.05), box_w + 0.75, cursor - first + 0.3,
                           fill=False, edgecolor="gray", linestyle="--"))
    ax.text(skip_x + 0.45, cursor + 0.1, "× N", ha="left", va="center", fontsize=FONT, color="gray", gid="stack")
    name(cursor + 0.1, f"{spec['stack']}[i]")
    final = box(cursor + 0.3, 0.45, f"final {spec['norm']}", "final-norm", COLOURS["norm"], spec["final"])
    head = box(final.top[1], 0.7, spec["head"], "head", COLOURS["embedding"], "lm_head")
    _arrow(ax, head.top, (x, head.top[1] + 0.25))
    ax.text(x, head.top[1] + 0.45, "logits [B, L, vocab]", ha="center", va="center", fontsize=FONT,
            gid="tensor:output")
    return head.top[1] + 0.75


def decoder_only_diagram(kinds=("gpt2", "llama"), *, changes=False) -> Diagram:
    """A decoder-only language model, drawn upwards, one panel per kind, side by side.

    ``kinds``: ``"gpt2"`` (``tfcore.GPT``: learned positions added once, LayerNorm, a GELU
    feed-forward layer, an output layer tied to the token embeddings) and/or ``"llama"``
    (``tfcore.Llama``: no position table, RMSNorm, grouped-query attention with rotary embeddings,
    SwiGLU, an output layer of its own). Both wire their blocks pre-norm: ``x = x +
    sublayer(norm(x))``, twice per block, then one final norm. The module names of tfcore's
    classes stand left of their boxes, in the order the block calls them; biases are not drawn.
    With ``changes=True`` the Llama panel numbers, in red, the four changes from GPT-2's block
    (1 RMSNorm, 2 rotary positions, 3 SwiGLU, 4 grouped-query attention, as chapter 16 numbers them), keyed under the titles.
    """
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    if not kinds or any(kind not in _DECODER_ONLY for kind in kinds):
        raise ValueError(f"kinds must be 'gpt2', 'llama' or a non-empty sequence of them, got {kinds!r}")
    panel_w = 7.4
    fig, ax = _canvas(panel_w * len(kinds), 14)
    # the boxes' centre: module names on the left, the skip lines and "× N" on the right
    tops = [_decoder_only_panel(ax, p * panel_w + 4.6, _DECODER_ONLY[kind], changes=changes)
            for p, kind in enumerate(kinds)]
    top = max(tops)
    if changes and "llama" in kinds:
        ax.text(panel_w * len(kinds) / 2, top + 0.2, CHANGES, ha="center", va="center", fontsize=FONT,
                color=CHANGE_COLOUR, gid="key")
        top += 0.5
    for p, kind in enumerate(kinds):
        ax.text(p * panel_w + 4.6, top + 0.2, _DECODER_ONLY[kind]["title"], ha="center", va="center",
                fontsize=FONT + 1, gid="title")
    _fit(fig, ax, panel_w * len(kinds), top + 0.5)
    return fig


def chat_template_figure(tokenizer, ids: dict, prompt: str, answer: str):
    """Chapter 25: draw one example in the chat template: its input tokens on top, below each one its target (the
    next token), and which targets the loss takes (``loss_mask``). Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    from . import instruct  # chapter 25's template; read at call time

    sequence, start = instruct.encode_chat(tokenizer, ids, prompt, answer)
    in_loss = instruct.loss_mask(len(sequence), start).tolist()
    names = [tokenizer.id_to_token(i).replace("\u0120", "\u2423") for i in sequence]  # a space shown as ␣
    n = len(sequence) - 1
    fig, ax = plt.subplots(figsize=(7.0, 2.4))  # the book's column: every text at 9 pt
    role = ["special" if i in ids.values() else "prompt" if t < start else "answer" for t, i in enumerate(sequence)]
    fill = {"special": "#d9d9d9", "prompt": "#cfe2f3", "answer": "#d9ead3"}
    widths = [max(1.0, 0.2 * max(len(names[t]), len(names[t + 1])) + 0.2) for t in range(n)]  # column t
    left = [sum(widths[:t]) for t in range(n)]
    for t in range(n):
        x, w = left[t], widths[t]
        for y, k, edge in ((1.0, t, "black"), (0.0, t + 1, "#d94801" if in_loss[t] else "#bdbdbd")):
            ax.add_patch(FancyBboxPatch((x + 0.06, y), w - 0.12, 0.5, boxstyle="round,pad=0.02", facecolor=fill[role[k]],
                                        edgecolor=edge, linewidth=2.2 if y == 0 and in_loss[t] else 0.8))
            ax.text(x + w / 2, y + 0.25, names[k], ha="center", va="center", fontsize=9,
                    color="black" if y == 1 or in_loss[t] else "#969696")
        ax.annotate("", (x + w / 2, 0.52), (x + w / 2, 0.98), arrowprops=dict(arrowstyle="->", color="#737373", lw=0.8))
    ax.text(-0.1, 1.25, "input", ha="right", va="center", fontsize=9)
    ax.text(-0.1, 0.25, "target", ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.1, sum(widths) + 0.1)
    ax.set_ylim(-0.15, 1.65)
    ax.axis("off")
    ax.set_title(f"{len(sequence)} tokens, {n} targets; the {sum(in_loss)} with an orange frame are in the loss\n"
                 f"(blue: prompt, green: answer, grey: special)", fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- Qwen3.5's hybrid

LINEAR_COLOUR = "#d9d2e9"  # the Gated DeltaNet's boxes (the attention layers keep COLOURS["attention"])
_LETTER = {LINEAR: "L", FULL: "F"}
_STACK_W = 4.6             # drawing units: the stack panel, then the Gated DeltaNet panel
_NET_W = 8.0


def _period(kinds: list) -> int:
    """The shortest p such that ``kinds`` is its first p entries repeated."""
    return next(p for p in range(1, len(kinds) + 1) if len(kinds) % p == 0 and kinds == kinds[:p] * (len(kinds) // p))


def _stack_rows(kinds: list) -> tuple[list, int]:
    """Which layers the stack panel draws, and how many times they repeat (0: not a repetition): every layer of a
    stack of at most 4; else one period of the pattern if it has at most 4 layers; else one layer of each kind."""
    if len(kinds) <= 4:
        return list(range(len(kinds))), 1
    period = _period(kinds)
    if period <= 4:
        return list(range(period)), len(kinds) // period
    return sorted({kind: kinds.index(kind) for kind in kinds}.values()), 0


def _pattern_text(kinds: list, rows: list, repeats: int) -> str:
    """``layer_types`` in letters (L linear, F full): the period drawn, or run lengths ("L×3 F ...")."""
    if repeats:
        return "layer_types: " + " ".join(_LETTER[kinds[i]] for i in rows) + (f", × {repeats}" if repeats > 1 else "")
    runs, i = [], 0
    while i < len(kinds):
        j = i
        while j < len(kinds) and kinds[j] == kinds[i]:
            j += 1
        runs.append(_LETTER[kinds[i]] + (f"×{j - i}" if j - i > 1 else ""))
        i = j
    lines = ["layer_types:"]
    for run in runs:
        if len(lines[-1]) + len(run) > 34:
            lines.append(" ")
        lines[-1] += " " + run
    return "\n".join(lines)


def _hybrid_stack_panel(ax, config, x0: float) -> float:
    """The stack drawn upwards from the left edge ``x0``: the residual stream on the left; each sublayer branches
    right (RMSNorm, then the mixer or the MLP) and is added back (+). Returns the top of the drawing."""
    kinds, hidden = config.layer_types, config.hidden_size
    rows, repeats = _stack_rows(kinds)
    xs = x0 + 0.6                                 # the residual stream
    norm_x, norm_w, mix_x, mix_w = xs + 0.85, 1.0, xs + 2.775, 2.35
    ax.text(xs - 0.3, 0.3, f"token embeddings {_shape('B', 'L', hidden)}", ha="left", va="center", fontsize=SMALL,
            gid="tensor:input")
    cursor = first = 0.5
    mlp = "SwiGLU" if config.hidden_act == "silu" else "gated MLP"
    for i in rows:
        if kinds[i] == LINEAR:
            state = _shape(config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
            mixer = f"Gated DeltaNet\nstate {state}", LINEAR_COLOUR
        else:
            heads = f"{config.num_attention_heads} q, {config.num_key_value_heads} kv heads of {config.head_dim}"
            mixer = f"gated attention\n{heads}", COLOURS["attention"]
        sublayers = [(mixer, f"layer:{kinds[i]}"),
                     ((f"{mlp}\n{hidden} → {config.intermediate_size} → {hidden}", COLOURS["feed_forward"]), "mlp")]
        bottom = cursor
        for (text, colour), role in sublayers:
            branch_y = cursor + 0.4
            ax.plot([xs, xs], [cursor, branch_y], color="black", lw=1.2)
            ax.add_patch(Circle((xs, branch_y), 0.05, color="black"))
            norm = _box(ax, norm_x, branch_y, norm_w, 0.34, "RMSNorm", "norm", COLOURS["norm"], fontsize=SMALL)
            _arrow(ax, (xs, branch_y), norm.left)
            box = _box(ax, mix_x, branch_y, mix_w, 0.56, text, role, colour, fontsize=SMALL)
            _arrow(ax, norm.right, box.left)
            add_y = box.top[1] + 0.2
            _arrow(ax, (xs, branch_y), (xs, add_y - 0.15))
            _add(ax, xs, add_y, 0.15)
            ax.plot([mix_x, mix_x, xs + 0.3], [box.top[1], add_y, add_y], color="black", lw=1.2)
            _arrow(ax, (xs + 0.3, add_y), (xs + 0.15, add_y))
            cursor = add_y + 0.15
        ax.text(xs - 0.3, (bottom + cursor) / 2 + 0.2, f"layer {i}", ha="center", va="center", fontsize=SMALL,
                rotation=90, gid="layer-index")
    if repeats > 1:
        right = mix_x + mix_w / 2 + 0.05
        ax.add_patch(Rectangle((xs - 0.5, first + 0.05), right - xs + 0.5, cursor - first + 0.1,
                               fill=False, edgecolor="gray", linestyle="--"))
        ax.text(right - 0.05, cursor + 0.2, f"× {repeats}", ha="right", va="bottom", fontsize=FONT,
                color="gray", gid="stack")
    elif repeats == 0:
        ax.text(mix_x + mix_w / 2, cursor + 0.02, "one layer of each kind", ha="right", va="bottom", fontsize=SMALL,
                color="gray", gid="stack")
    final = _box(ax, xs + 1.0, cursor + 0.45 + 0.17, 2.5, 0.34, "final RMSNorm", "final-norm", COLOURS["norm"],
                 fontsize=SMALL)
    _arrow(ax, (xs, cursor), (xs, final.bottom[1]))
    head = _box(ax, xs + 1.0, final.top[1] + 0.3 + 0.17, 2.5, 0.34, f"lm_head → {_shape('B', 'L', config.vocab_size)}",
                "head", COLOURS["embedding"], fontsize=SMALL)
    _arrow(ax, final.top, head.bottom)
    counts = " + ".join(f"{kinds.count(kind)} {name}" for kind, name in
                        ((LINEAR, "Gated DeltaNet"), (FULL, "attention")) if kind in kinds)
    pattern = f"{len(kinds)} layers: {counts}\n{_pattern_text(kinds, rows, repeats)}"
    if config.hidden_act != "silu":
        pattern += f"\nhidden_act: {config.hidden_act}"
    ax.text(x0 + 0.1, head.top[1] + 0.2, pattern, ha="left", va="bottom", fontsize=SMALL, gid="pattern")
    return head.top[1] + 0.2 + 0.25 * (pattern.count("\n") + 1)


def _delta_net_panel(ax, config, x0: float, top: float) -> float:
    """One Gated DeltaNet layer for one token, drawn upwards from the left edge ``x0`` to about ``top``, in the
    order ``GatedDeltaNet.forward`` computes: the main path in the middle, what else is computed from x on the
    left, the cached tensors (memory colour) on the right. Returns the top of the drawing."""
    hidden, kernel, act = config.hidden_size, config.linear_conv_kernel_dim, config.hidden_act
    h_k, h_v, d_k, d_v = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                          config.linear_value_head_dim)
    conv_dim = config.conv_dim
    feed_x, side_x, side_w = x0 + 0.3, x0 + 1.7, 2.5     # the line from x; the boxes it feeds (centre, width)
    main_x, main_w = x0 + 4.5, 2.6                        # the main path
    cache_x, cache_w = x0 + 7.05, 1.5                     # what the cache keeps
    heights = [0.56, 0.56, 0.56, 0.56, 0.56, 1.4, 0.36, 0.56]
    gap = max(0.32, (top - 0.45 - 0.75 - sum(heights)) / len(heights))
    cursor = 0.45
    ax.text(main_x, 0.3, f"x: one token {_shape(hidden)}", ha="center", va="center", fontsize=FONT, gid="tensor:x")

    def step(text, role, colour=COLOURS["tensor"], label=None, label_role="op"):
        nonlocal cursor
        height = heights.pop(0)
        b = _box(ax, main_x, cursor + gap + height / 2, main_w, height, text, role, colour, fontsize=SMALL)
        _arrow(ax, (main_x, cursor), b.bottom, label, where="right", role=label_role, fontsize=SMALL)
        cursor = b.top[1]
        return b

    step(f"in_proj_qkv:\nLinear({hidden}, {conv_dim})", "op:in_proj_qkv")
    conv = step(f"causal conv1d, kernel {kernel}:\neach channel, its last {kernel}", "op:conv1d",
                label=f"q, k, v {_shape(conv_dim)}", label_role="tensor:qkv")
    step(f"split into heads:\nq, k {_shape(h_k, d_k)}; v {_shape(h_v, d_v)}", "op:split", label=f"act: {act}",
         label_role="op:act")
    step(f"grouped value heads: q, k\nrepeated × {h_v // h_k} → {_shape(h_v, d_k)}" if h_v > h_k else
         "grouped value heads: none,\none key head per value head", "op:repeat")
    step(f"L2-normalise q and k,\nthen q × 1/√{d_k}", "op:l2norm")
    rule = step("gated delta rule\nS ← αS + β kᵀ(v − α k S)\no = q S, each value head\n"
                f"prompt: chunks of {GatedDeltaNet.chunk_size}\nnew token: one step", "op:rule", LINEAR_COLOUR)
    gated = step("RMSNorm(o) · silu(z)", "op:gated_norm", label=f"o {_shape(h_v, d_v)}", label_role="tensor:o")
    out = step(f"out_proj:\nLinear({h_v * d_v}, {hidden})", "op:out_proj", label=f"{_shape(h_v, d_v)}",
               label_role="tensor:gated")
    _arrow(ax, out.top, (main_x, out.top[1] + 0.25))
    ax.text(main_x, out.top[1] + 0.42, f"output {_shape(hidden)}", ha="center", va="center", fontsize=FONT,
            gid="tensor:output")

    # computed from x, on the left, upwards in the order forward computes them: beta and g into the rule, z into
    # the gated norm
    feeds = [(rule.y - 0.5, 0.56, f"β = sigmoid(in_proj_b x)\n{_shape(h_v)}: write strength", "op:beta", rule),
             (rule.y + 0.35, 1.0, f"g = −exp(A_log) ·\nsoftplus(in_proj_a x\n+ dt_bias) {_shape(h_v)}\ndecay α = e^g",
              "op:g", rule),
             (gated.y, 0.56, f"z = in_proj_z x\n{_shape(h_v, d_v)}: output gate", "op:z", gated)]
    branch = (main_x, 0.45 + gap / 2)
    ax.add_patch(Circle(branch, 0.05, color="black"))
    ax.plot([branch[0], feed_x, feed_x], [branch[1], branch[1], feeds[-1][0]], color="black", lw=1.2)
    for y, height, text, role, target in feeds:
        b = _box(ax, side_x, y, side_w, height, text, role, COLOURS["tensor"], fontsize=SMALL)
        _arrow(ax, (feed_x, y), b.left)
        _arrow(ax, b.right, (target.left[0], y))
    # on the right, what the cache keeps: the convolution's last inputs and the delta rule's state
    conv_state = _box(ax, cache_x, conv.y, cache_w, 0.75, f"conv state\n{_shape(conv_dim, kernel - 1)}\ncached",
                      "tensor:conv_state", COLOURS["memory"], fontsize=SMALL)
    _arrow(ax, (conv_state.left[0], conv.y + 0.12), (conv.right[0], conv.y + 0.12))
    _arrow(ax, (conv.right[0], conv.y - 0.12), (conv_state.left[0], conv.y - 0.12))
    state = _box(ax, cache_x, rule.y, cache_w, 0.75, f"state S\n{_shape(h_v, d_k, d_v)}\ncached",
                 "tensor:state", COLOURS["memory"], fontsize=SMALL)
    _arrow(ax, (rule.right[0], rule.y + 0.25), (state.left[0], state.y + 0.25), rad=-0.35)
    _arrow(ax, (state.left[0], state.y - 0.25), (rule.right[0], rule.y - 0.25), rad=-0.35)
    ax.text(cache_x, state.top[1] + 0.08, "carried to\nthe next token", ha="center", va="bottom", fontsize=SMALL,
            gid="note")
    return out.top[1] + 0.6


def hybrid_diagram(config) -> Diagram:
    """Qwen3.5's hybrid (``tfcore.hybrid.Qwen35``) with the sizes of ``config``, a ``tfcore.hybrid.Qwen35Config``.

    Left, the stack as ``config.layer_types`` orders it, drawn upwards: the residual stream, and in each block an
    RMSNorm then the token mixer (a Gated DeltaNet or a gated attention layer), added back (+), then an RMSNorm
    then the gated MLP, added back. A stack of more than 4 layers is drawn as one period of its pattern and
    "× repeats" (one layer of each kind if the period is longer than 4); the count of each kind and the pattern
    (L linear, F full) are written above it. Right, one Gated DeltaNet layer for one token, in the order
    ``GatedDeltaNet.forward`` computes, with the per-token shapes: ``in_proj_qkv``, the causal convolution, the
    activation, the split into heads, the key heads repeated for the value heads, the L2 norm of q and k (inside
    the rule functions, after the repeat, as in transformers), the gated delta rule with its state
    ``S [H_v, d_k, d_v]``, ``RMSNorm(o) · silu(z)``, ``out_proj``. beta, g and z are computed from x (left); what
    the cache keeps, the convolution state ``[conv_dim, K - 1]`` and S, is in the memory colour (right).
    """
    if not isinstance(config, Qwen35Config):
        raise TypeError(f"config must be a tfcore.hybrid.Qwen35Config, got {type(config).__name__}; for a "
                        f"transformers model, pass tfcore.Qwen35.from_transformers(model).config")
    width = _STACK_W + _NET_W
    fig, ax = _canvas(width, 14)
    stack_top = _hybrid_stack_panel(ax, config, 0.0)
    top = max(stack_top, _delta_net_panel(ax, config, _STACK_W, stack_top))
    ax.text(_STACK_W / 2, top + 0.25, "the stack (tfcore.Qwen35)", ha="center", va="center", fontsize=FONT + 1,
            gid="title")
    ax.text(_STACK_W + _NET_W / 2, top + 0.25, "one Gated DeltaNet layer, one token", ha="center", va="center",
            fontsize=FONT + 1, gid="title")
    _fit(fig, ax, width, top + 0.55)
    return fig
