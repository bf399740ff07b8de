//! Every reference backward agrees with central finite differences of its reference forward
//! (f64, h = 1e-5: truncation ~h² and cancellation ~1e-16/h, both far below the 1e-7 tolerance).

use crate::common;

use common::{Rng, rope_tables, to_f64};
use kernels::attention::AttentionDims;
use kernels::matmul::Layout;
use kernels::reference as r;
use kernels::rope::RopeDims;

const H: f64 = 1e-5;

/// Check `grad` against the numerical gradient of `loss` at `x`, element by element.
fn check(what: &str, x: &[f64], grad: &[f64], loss: impl Fn(&[f64]) -> f64) {
    let scale = grad.iter().fold(0f64, |m, g| m.max(g.abs())).max(1e-3);
    let mut xp = x.to_vec();
    for i in 0..x.len() {
        xp[i] = x[i] + H;
        let up = loss(&xp);
        xp[i] = x[i] - H;
        let down = loss(&xp);
        xp[i] = x[i];
        let num = (up - down) / (2.0 * H);
        assert!(
            (num - grad[i]).abs() <= 1e-7 * scale,
            "{what}[{i}]: analytic {} vs numeric {num}",
            grad[i]
        );
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

#[test]
fn encoder_backward_matches_finite_differences() {
    let mut rng = Rng::new(11);
    let (t, c, v) = (3, 4, 5);
    let tokens = rng.tokens(2 * t, v);
    let (wte, wpe, dout) = (
        rng.vec(v * c, 1.0),
        rng.vec(t * c, 1.0),
        rng.vec(2 * t * c, 1.0),
    );
    let (dwte, dwpe) = r::encoder_backward(&dout, &tokens, v, t, c);
    check("dwte", &wte, &dwte, |x| {
        dot(&dout, &r::encoder_forward(&tokens, x, &wpe, t, c))
    });
    check("dwpe", &wpe, &dwpe, |x| {
        dot(&dout, &r::encoder_forward(&tokens, &wte, x, t, c))
    });
}

#[test]
fn layernorm_backward_matches_finite_differences() {
    let mut rng = Rng::new(12);
    let (rows, c) = (3, 7);
    let (inp, w, b, dout) = (
        rng.vec(rows * c, 2.0),
        rng.vec(c, 1.0),
        rng.vec(c, 1.0),
        rng.vec(rows * c, 1.0),
    );
    let (_, mean, rstd) = r::layernorm_forward(&inp, &w, &b);
    let (di, dw, db) = r::layernorm_backward(&dout, &inp, &w, &mean, &rstd);
    check("dinp", &inp, &di, |x| {
        dot(&dout, &r::layernorm_forward(x, &w, &b).0)
    });
    check("dweight", &w, &dw, |x| {
        dot(&dout, &r::layernorm_forward(&inp, x, &b).0)
    });
    check("dbias", &b, &db, |x| {
        dot(&dout, &r::layernorm_forward(&inp, &w, x).0)
    });
}

#[test]
fn matmul_backward_matches_finite_differences() {
    let mut rng = Rng::new(13);
    let s = (3, 4, 5);
    for layout in [Layout::KN, Layout::NK] {
        let (inp, w, b, dout) = (
            rng.vec(12, 1.0),
            rng.vec(20, 1.0),
            rng.vec(5, 1.0),
            rng.vec(15, 1.0),
        );
        let (di, dw, db) = r::matmul_backward(&dout, &inp, &w, layout, s);
        check("dinp", &inp, &di, |x| {
            dot(&dout, &r::matmul_forward(x, &w, Some(&b), layout, s))
        });
        check("dweight", &w, &dw, |x| {
            dot(&dout, &r::matmul_forward(&inp, x, Some(&b), layout, s))
        });
        check("dbias", &b, &db, |x| {
            dot(&dout, &r::matmul_forward(&inp, &w, Some(x), layout, s))
        });
    }
}

#[test]
fn attention_backward_matches_finite_differences() {
    let mut rng = Rng::new(14);
    let (c, d) = (6, AttentionDims::mha(2, 4, 6, 2));
    let (qkv, dout) = (rng.vec(d.b * d.t * 3 * c, 1.0), rng.vec(d.b * d.t * c, 1.0));
    let (out, att) = r::attention_forward(&qkv, d);
    let dqkv = r::attention_backward(&dout, &qkv, &att, &out, d);
    check("dqkv", &qkv, &dqkv, |x| {
        dot(&dout, &r::attention_forward(x, d).0)
    });
}

/// Two query heads per key/value head: dk and dv sum over the group.
#[test]
fn gqa_attention_backward_matches_finite_differences() {
    let mut rng = Rng::new(18);
    let d = AttentionDims::gqa(2, 4, 4, 2, 3);
    let (qn, kn) = (d.b * d.t * d.q_width(), d.b * d.t * d.kv_width());
    let (q, k, v, dout) = (
        rng.vec(qn, 1.0),
        rng.vec(kn, 1.0),
        rng.vec(kn, 1.0),
        rng.vec(qn, 1.0),
    );
    let (out, att) = r::gqa_attention_forward(&q, &k, &v, d);
    let (dq, dk, dv) = r::gqa_attention_backward(&dout, &q, &k, &v, &att, &out, d);
    check("dq", &q, &dq, |x| {
        dot(&dout, &r::gqa_attention_forward(x, &k, &v, d).0)
    });
    check("dk", &k, &dk, |x| {
        dot(&dout, &r::gqa_attention_forward(&q, x, &v, d).0)
    });
    check("dv", &v, &dv, |x| {
        dot(&dout, &r::gqa_attention_forward(&q, &k, x, d).0)
    });
}

#[test]
fn rmsnorm_backward_matches_finite_differences() {
    let mut rng = Rng::new(19);
    let (rows, c, eps) = (3, 7, 1e-6);
    let (inp, w, dout) = (
        rng.vec(rows * c, 2.0),
        rng.vec(c, 1.0),
        rng.vec(rows * c, 1.0),
    );
    let (_, rstd) = r::rmsnorm_forward(&inp, &w, eps);
    let (di, dw) = r::rmsnorm_backward(&dout, &inp, &w, &rstd);
    check("dinp", &inp, &di, |x| {
        dot(&dout, &r::rmsnorm_forward(x, &w, eps).0)
    });
    check("dweight", &w, &dw, |x| {
        dot(&dout, &r::rmsnorm_forward(&inp, x, eps).0)
    });
}

#[test]
fn rope_backward_matches_finite_differences() {
    let mut rng = Rng::new(20);
    let d = RopeDims {
        t: 3,
        heads: 2,
        head_dim: 6,
    };
    let (cos, sin) = rope_tables(d.t, d.head_dim);
    let (cos, sin) = (to_f64(&cos), to_f64(&sin));
    let n = 2 * d.t * d.heads * d.head_dim;
    let (x, dout) = (rng.vec(n, 1.0), rng.vec(n, 1.0));
    let dx = r::rope(&dout, &cos, &sin, d, true);
    check("dx", &x, &dx, |x| {
        dot(&dout, &r::rope(x, &cos, &sin, d, false))
    });
}

#[test]
fn swiglu_backward_matches_finite_differences() {
    let mut rng = Rng::new(21);
    let (g, u, dout) = (rng.vec(50, 6.0), rng.vec(50, 2.0), rng.vec(50, 1.0));
    let (dg, du) = r::swiglu_backward(&dout, &g, &u);
    check("dgate", &g, &dg, |x| dot(&dout, &r::swiglu_forward(x, &u)));
    check("dup", &u, &du, |x| dot(&dout, &r::swiglu_forward(&g, x)));
}

#[test]
fn gelu_backward_matches_finite_differences() {
    let mut rng = Rng::new(15);
    let (x, dout) = (rng.vec(50, 4.0), rng.vec(50, 1.0));
    check("dgelu", &x, &r::gelu_backward(&dout, &x), |x| {
        dot(&dout, &r::gelu_forward(x))
    });
}

#[test]
fn residual_backward_is_identity() {
    let mut rng = Rng::new(16);
    let (a, b, dout) = (rng.vec(9, 1.0), rng.vec(9, 1.0), rng.vec(9, 1.0));
    check("da", &a, &dout, |x| dot(&dout, &r::residual_forward(x, &b)));
    check("db", &b, &dout, |x| dot(&dout, &r::residual_forward(&a, x)));
}

#[test]
fn crossentropy_backward_matches_finite_differences() {
    let mut rng = Rng::new(17);
    let (n, v, dloss) = (3, 6, 0.7);
    let (logits, targets) = (rng.vec(n * v, 3.0), rng.tokens(n, v));
    let d = r::crossentropy_backward(&logits, &targets, v, dloss);
    check("dlogits", &logits, &d, |x| {
        dloss * r::crossentropy_forward(x, &targets, v).iter().sum::<f64>()
    });
}
