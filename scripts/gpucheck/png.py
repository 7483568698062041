"""The timeline PNG of one out-of-core iteration, drawn without any plotting library (the
GPU machines have none): four bands, top to bottom, compute (blue), host-to-device copies
(green), device-to-host copies (orange) and device memory in use (grey area, full height =
its peak). Time runs left to right over the iteration; report.json names the lanes."""

import json
import struct
import zlib
from pathlib import Path

WIDTH, BAND, GAP = 1200, 80, 10
LANES = (("compute", (52, 101, 164)), ("h2d", (78, 154, 6)), ("d2h", (206, 92, 0)))
MEMORY = (136, 138, 133)


def write_png(path, pixels, width, height):
    """Writes rows of (r, g, b) bytes as an 8-bit RGB PNG."""
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def render(data, path):
    """Draws ``data`` (lanes of [start, end] seconds, memory [t, bytes] samples)."""
    lanes = data.get("lanes") or {}
    memory = data.get("memory") or []
    end = max([s[1] for lane in lanes.values() for s in lane]
              + [t for t, _ in memory] + [1e-9])
    height = GAP + (len(LANES) + 1) * (BAND + GAP)
    rows = [bytearray(b"\xff" * (WIDTH * 3)) for _ in range(height)]

    def fill(x0, x1, y0, y1, color):
        x0, x1 = max(0, min(WIDTH - 1, x0)), max(0, min(WIDTH, max(x1, x0 + 1)))
        for y in range(y0, y1):
            rows[y][x0 * 3:x1 * 3] = bytes(color) * (x1 - x0)

    for i, (name, color) in enumerate(LANES):
        y0 = GAP + i * (BAND + GAP)
        fill(0, WIDTH, y0 + BAND, y0 + BAND + 1, (200, 200, 200))
        for start, stop in lanes.get(name, []):
            fill(int(start / end * WIDTH), int(stop / end * WIDTH), y0, y0 + BAND, color)
    y0 = GAP + len(LANES) * (BAND + GAP)
    peak = max([b for _, b in memory] + [1])
    # A step function: each sample holds until the next one.
    for (t, used), (t_next, _) in zip(memory, memory[1:] + [(end, 0)]):
        h = int(used / peak * BAND)
        fill(int(t / end * WIDTH), int(t_next / end * WIDTH), y0 + BAND - h, y0 + BAND, MEMORY)
    write_png(path, rows, WIDTH, height)
    return {"width": WIDTH, "height": height, "seconds": end}


def timeline_step(out):
    """The timeline section: timeline.json (written by torch_out_of_core) -> timeline.png."""
    source = Path(out) / "timeline.json"
    if not source.exists():
        return {"ran_on": None, "status": "skipped", "reason": "no profiled out-of-core "
                "iteration (torch_out_of_core did not get that far)", "result": None}
    data = json.loads(source.read_text())
    png = Path(out) / "timeline.png"
    drawn = render(data, png)
    lanes = [f"{name} ({'rgb%s' % (color,)})" for name, color in LANES]
    lanes.append(f"device memory in use (rgb{MEMORY}, band height = peak "
                 f"{max([b for _, b in data.get('memory') or []] + [0])} bytes)")
    return {"ran_on": data.get("source"), "reason": None, "result": {
        "png": str(png), "source": data.get("source"), "lanes": lanes,
        "seconds": drawn["seconds"],
        "events": {k: len(v) for k, v in (data.get("lanes") or {}).items()}}}
