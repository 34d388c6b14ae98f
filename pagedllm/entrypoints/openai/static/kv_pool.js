// The pool: every block a cell of one canvas (fast for tens of thousands of cells) and, for tests and
// assistive tools, a hidden DOM element each (#cells > i[data-block-id][data-state][data-ref-cnt]) that is
// touched only where a block's state changed. Block tables are drawn over the cells in logical order.

export class PoolView {
  constructor(canvas, cellsDiv, wrap) {
    this.canvas = canvas;
    this.ctx = canvas.getContext("2d");
    this.cellsDiv = cellsDiv;
    this.wrap = wrap;
    this.states = ""; // one character per block: the index of its state in `names`
    this.names = [];
    this.colors = [];
    this.refCnts = {};
    this.cols = 1;
    this.cell = 8;
    this.drawMs = 0;
  }

  get size() {
    return this.states.length;
  }

  stateOf(id) {
    return this.names[this.states.charCodeAt(id) - 48] || "free";
  }

  // A new snapshot's states; true when any cell changed.
  update(states, names, refCnts) {
    if (states.length !== this.cellsDiv.children.length) this.build(states.length);
    if (names.join() !== this.names.join()) {
      this.names = names;
      const css = getComputedStyle(document.documentElement);
      this.colors = names.map((name) => css.getPropertyValue(`--kv-${name}`).trim() || "#000");
    }
    const cells = this.cellsDiv.children;
    const prev = this.states;
    const changed = states !== prev;
    if (changed) {
      for (let i = 0; i < states.length; i += 1) {
        if (states[i] !== prev[i]) cells[i].dataset.state = names[states.charCodeAt(i) - 48];
      }
    }
    for (const id of Object.keys(this.refCnts)) {
      if (!(id in refCnts)) cells[id].removeAttribute("data-ref-cnt");
    }
    for (const [id, n] of Object.entries(refCnts)) {
      if (this.refCnts[id] !== n) cells[id].dataset.refCnt = n;
    }
    this.states = states;
    this.refCnts = refCnts;
    return changed;
  }

  build(n) {
    const parts = new Array(n);
    for (let i = 0; i < n; i += 1) parts[i] = `<i data-block-id="${i}" data-state="free"></i>`;
    this.cellsDiv.innerHTML = parts.join("");
    this.states = "";
    this.refCnts = {};
    this.layout(n);
  }

  layout(n = this.size) {
    const width = Math.max(200, this.wrap.clientWidth);
    const maxHeight = Math.max(240, window.innerHeight * 0.5);
    this.cell = Math.max(3, Math.min(18, Math.floor(Math.sqrt((width * maxHeight) / Math.max(1, n)))));
    this.cols = Math.max(1, Math.floor(width / this.cell));
    const rows = Math.ceil(n / this.cols);
    const dpr = window.devicePixelRatio || 1;
    this.canvas.style.width = `${this.cols * this.cell}px`;
    this.canvas.style.height = `${rows * this.cell}px`;
    this.canvas.width = Math.round(this.cols * this.cell * dpr);
    this.canvas.height = Math.round(rows * this.cell * dpr);
  }

  origin(id) {
    return [(id % this.cols) * this.cell, Math.floor(id / this.cols) * this.cell];
  }

  // The block under a point of the page, or -1.
  blockAt(clientX, clientY) {
    const rect = this.canvas.getBoundingClientRect();
    const col = Math.floor((clientX - rect.left) / this.cell);
    const row = Math.floor((clientY - rect.top) / this.cell);
    const id = row * this.cols + col;
    return col >= 0 && col < this.cols && row >= 0 && id < this.size ? id : -1;
  }

  cellCenter(id) {
    const rect = this.canvas.getBoundingClientRect();
    const [x, y] = this.origin(id);
    return { x: rect.left + x + this.cell / 2, y: rect.top + y + this.cell / 2 };
  }

  // Every cell in its state's color (one path a state), then each [table, finished] over them.
  draw(tables) {
    const start = performance.now();
    const { ctx, cell, states } = this;
    const dpr = window.devicePixelRatio || 1;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, this.canvas.width, this.canvas.height);
    const gap = cell >= 6 ? 1 : 0;
    const byState = this.names.map(() => []);
    for (let i = 0; i < states.length; i += 1) byState[states.charCodeAt(i) - 48].push(i);
    byState.forEach((ids, s) => {
      ctx.fillStyle = this.colors[s];
      ctx.beginPath();
      for (const id of ids) {
        const [x, y] = this.origin(id);
        ctx.rect(x, y, cell - gap, cell - gap);
      }
      ctx.fill();
    });
    for (const [table, finished] of tables) this.drawTable(table, finished);
    this.drawMs = performance.now() - start;
  }

  // A block table onto the pool: its blocks outlined, a line through them in logical order and a dot on
  // logical block 0: the arrows of the PagedAttention picture, from a request into one shared pool.
  drawTable(table, finished) {
    const { ctx, cell } = this;
    const half = cell / 2;
    ctx.save();
    ctx.strokeStyle = finished ? "rgba(0,0,0,0.45)" : "#111";
    ctx.lineWidth = Math.max(1, cell / 8);
    ctx.setLineDash(finished ? [3, 3] : []);
    const points = table.filter((id) => id >= 0).map((id) => this.origin(id));
    for (const [x, y] of points) ctx.strokeRect(x + 0.5, y + 0.5, cell - 2, cell - 2);
    ctx.beginPath();
    points.forEach(([x, y], i) => (i ? ctx.lineTo(x + half, y + half) : ctx.moveTo(x + half, y + half)));
    ctx.globalAlpha = 0.6;
    ctx.stroke();
    if (points.length) {
      const [x, y] = points[0];
      ctx.globalAlpha = 1;
      ctx.fillStyle = "#111";
      ctx.beginPath();
      ctx.arc(x + half, y + half, Math.max(2, cell / 4), 0, 2 * Math.PI);
      ctx.fill();
    }
    ctx.restore();
  }
}
