/**
 * Reverse-mode automatic differentiation on scalars, for the exactness proof's tiny transformer: every operation
 * appends one node holding its value and the local derivatives with respect to (at most) two inputs; `backward`
 * sweeps the tape once in reverse. Float64 throughout. Small models only (one node per scalar operation).
 */
export class Tape {
  private val = new Float64Array(1 << 16);
  private a = new Int32Array(1 << 16);
  private b = new Int32Array(1 << 16);
  private da = new Float64Array(1 << 16);
  private db = new Float64Array(1 << 16);
  size = 0;

  value(i: number): number {
    return this.val[i];
  }

  private node(v: number, a: number, da: number, b: number, db: number): number {
    if (this.size === this.val.length) {
      const grow = <T extends Float64Array | Int32Array>(x: T): T => {
        const y = new (x.constructor as new (n: number) => T)(x.length * 2);
        y.set(x);
        return y;
      };
      this.val = grow(this.val);
      this.a = grow(this.a);
      this.b = grow(this.b);
      this.da = grow(this.da);
      this.db = grow(this.db);
    }
    const i = this.size++;
    this.val[i] = v;
    this.a[i] = a;
    this.da[i] = da;
    this.b[i] = b;
    this.db[i] = db;
    return i;
  }

  leaf(v: number): number {
    return this.node(v, -1, 0, -1, 0);
  }
  add(x: number, y: number): number {
    return this.node(this.val[x] + this.val[y], x, 1, y, 1);
  }
  sub(x: number, y: number): number {
    return this.node(this.val[x] - this.val[y], x, 1, y, -1);
  }
  mul(x: number, y: number): number {
    return this.node(this.val[x] * this.val[y], x, this.val[y], y, this.val[x]);
  }
  div(x: number, y: number): number {
    const vy = this.val[y];
    return this.node(this.val[x] / vy, x, 1 / vy, y, -this.val[x] / (vy * vy));
  }
  /** c * x + d for constants c, d. */
  affine(x: number, c: number, d = 0): number {
    return this.node(c * this.val[x] + d, x, c, -1, 0);
  }
  exp(x: number): number {
    const e = Math.exp(this.val[x]);
    return this.node(e, x, e, -1, 0);
  }
  log(x: number): number {
    return this.node(Math.log(this.val[x]), x, 1 / this.val[x], -1, 0);
  }
  pow(x: number, p: number): number {
    const v = this.val[x];
    return this.node(v ** p, x, p * v ** (p - 1), -1, 0);
  }
  sum(xs: ArrayLike<number>): number {
    let s = xs[0];
    for (let i = 1; i < xs.length; i++) s = this.add(s, xs[i]);
    return s;
  }
  dot(xs: ArrayLike<number>, ys: ArrayLike<number>): number {
    let s = this.mul(xs[0], ys[0]);
    for (let i = 1; i < xs.length; i++) s = this.add(s, this.mul(xs[i], ys[i]));
    return s;
  }

  /** d out / d node for every node (index by node id). */
  backward(out: number): Float64Array {
    const g = new Float64Array(this.size);
    g[out] = 1;
    for (let i = out; i >= 0; i--) {
      const gi = g[i];
      if (gi === 0) continue;
      if (this.a[i] >= 0) g[this.a[i]] += this.da[i] * gi;
      if (this.b[i] >= 0) g[this.b[i]] += this.db[i] * gi;
    }
    return g;
  }
}
