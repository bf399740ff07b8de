//! Token embeddings, plus learned position embeddings where the model has them (GPT-2; Llama
//! has none: its positions are rotary, `crate::rope`).

use crate::Float;
use crate::math::BLOCK;
use crate::par::{SharedMut, for_ranges};
use rayon::prelude::*;

/// `out (B, T, C) = wte[tokens] (+ wpe[0..T])`; `tokens (B, T)`, `wte (V, C)`, `wpe (maxT, C)`.
pub fn encoder_forward<X: Float>(
    out: &mut [X],
    tokens: &[u32],
    wte: &[X],
    wpe: Option<&[X]>,
    t: usize,
    c: usize,
) {
    assert_eq!(out.len(), tokens.len() * c, "out must be (B, T, C)");
    check_positions(tokens.len(), t, c, wpe.map(<[X]>::len));
    let v = wte.len() / c;
    out.par_chunks_mut(c).enumerate().for_each(|(i, o)| {
        let tok = tokens[i] as usize;
        assert!(tok < v, "token {tok} outside the vocabulary of {v}");
        let e = &wte[tok * c..][..c];
        let Some(wpe) = wpe else {
            o.copy_from_slice(e);
            return;
        };
        let p = &wpe[(i % t) * c..][..c];
        let (mut a, mut b) = ([0f32; BLOCK], [0f32; BLOCK]);
        for ((o, e), p) in o
            .chunks_mut(BLOCK)
            .zip(e.chunks(BLOCK))
            .zip(p.chunks(BLOCK))
        {
            let w = o.len();
            X::cast_to_f32(e, &mut a[..w]);
            X::cast_to_f32(p, &mut b[..w]);
            a[..w].iter_mut().zip(&b[..w]).for_each(|(a, b)| *a += b);
            X::cast_from_f32(&a[..w], o);
        }
    });
}

/// Checks `tokens (B, T)` and that `wpe`, when there is one, covers T positions.
pub(crate) fn check_positions(bt: usize, t: usize, c: usize, wpe: Option<usize>) {
    assert!(t > 0 && bt.is_multiple_of(t), "tokens must be (B, T)");
    if let Some(len) = wpe {
        assert!(len >= t * c, "wpe must cover T positions");
    }
}

/// Backward: `dwte[v] += Σ dout` over the positions holding token v and, when the model has
/// learned positions, `dwpe[t] += Σ_b dout[b, t]`.
///
/// Each row's contributions are summed in f32 in position order and added once. Allocates
/// one `u32` per token position (to group positions by token), nothing proportional to C.
pub fn encoder_backward<X: Float>(
    dwte: &mut [X],
    dwpe: Option<&mut [X]>,
    dout: &[X],
    tokens: &[u32],
    t: usize,
    c: usize,
) {
    assert_eq!(dout.len(), tokens.len() * c, "dout must be (B, T, C)");
    check_positions(tokens.len(), t, c, dwpe.as_deref().map(<[X]>::len));
    let bt = tokens.len();
    if let Some(dwpe) = dwpe {
        dwpe[..t * c]
            .par_chunks_mut(c)
            .enumerate()
            .for_each(|(pos, d)| {
                add_rows(d, (pos..bt).step_by(t), dout, c);
            });
    }
    // Positions sorted by (token, position): each token's run is one task writing its own row.
    let mut order: Vec<u32> = (0..bt as u32).collect();
    order.sort_by_key(|&i| tokens[i as usize]);
    let v = dwte.len() / c;
    let dwte = SharedMut::new(dwte);
    let order = &order;
    for_ranges(bt, 1, |r| {
        let i = r.start;
        let tok = tokens[order[i] as usize];
        if i > 0 && tokens[order[i - 1] as usize] == tok {
            return; // not the first position of its run
        }
        let run = order[i..]
            .iter()
            .take_while(|&&j| tokens[j as usize] == tok);
        assert!(
            (tok as usize) < v,
            "token {tok} outside the vocabulary of {v}"
        );
        // SAFETY: one task per distinct token, so rows never overlap.
        let d = unsafe { dwte.slice(tok as usize * c..(tok as usize + 1) * c) };
        add_rows(d, run.map(|&j| j as usize), dout, c);
    });
}

/// `d += Σ_{i ∈ rows} src[i]`, summed in f32 in iteration order, rounded once.
fn add_rows<X: Float>(d: &mut [X], rows: impl Iterator<Item = usize> + Clone, src: &[X], c: usize) {
    let (mut acc, mut row) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (j0, d) in (0..c).step_by(BLOCK).zip(d.chunks_mut(BLOCK)) {
        let w = d.len();
        X::cast_to_f32(d, &mut acc[..w]);
        let mut sum = [0f32; BLOCK];
        for i in rows.clone() {
            X::cast_to_f32(&src[i * c + j0..][..w], &mut row[..w]);
            sum[..w]
                .iter_mut()
                .zip(&row[..w])
                .for_each(|(s, x)| *s += x);
        }
        acc[..w]
            .iter_mut()
            .zip(&sum[..w])
            .for_each(|(a, s)| *a += s);
        X::cast_from_f32(&acc[..w], d);
    }
}
