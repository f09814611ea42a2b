//! Strided walks: the flat offsets of a box, a transposition or a strided slice of a
//! row-major array, produced one at a time instead of as an index vector (which would hold
//! eight bytes per element beside the four of a float copy).

/// The flat offsets `base + Σ_d i_d · steps[d]` for every index `i` of `shape`, in row-major
/// order of `shape`.
#[derive(Clone, Debug)]
pub struct Walk {
    shape: Vec<usize>,
    steps: Vec<usize>,
    at: Vec<usize>,
    flat: usize,
    left: usize,
}

impl Walk {
    /// The walk over `shape` from `base` with per-dim `steps`.
    pub fn new(shape: Vec<usize>, steps: Vec<usize>, base: usize) -> Walk {
        debug_assert_eq!(shape.len(), steps.len());
        let left = shape.iter().product();
        Walk { at: vec![0; shape.len()], shape, steps, flat: base, left }
    }

    /// The box `ranges` (per dim `[start, end)`) of an array of `shape`.
    pub fn boxed(shape: &[usize], ranges: &[(usize, usize)]) -> Walk {
        let st = super::strides(shape);
        let base = ranges.iter().zip(&st).map(|(r, s)| r.0 * s).sum();
        Walk::new(ranges.iter().map(|(s, e)| e - s).collect(), st, base)
    }
}

impl Iterator for Walk {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let v = self.flat;
        for d in (0..self.shape.len()).rev() {
            self.at[d] += 1;
            self.flat += self.steps[d];
            if self.at[d] < self.shape[d] {
                break;
            }
            self.flat -= self.steps[d] * self.at[d];
            self.at[d] = 0;
        }
        Some(v)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for Walk {}

#[cfg(test)]
mod tests {
    use super::Walk;

    #[test]
    fn a_box_walks_its_rows_in_order() {
        // [2, 3, 4], rows 1..2, columns 1..3 of each.
        let got: Vec<usize> = Walk::boxed(&[2, 3, 4], &[(0, 2), (1, 2), (1, 3)]).collect();
        assert_eq!(got, vec![5, 6, 17, 18]);
    }

    #[test]
    fn a_transposition_walks_the_input_by_its_permuted_strides() {
        // x: [2, 3] (strides 3, 1) read as its transpose [3, 2].
        let got: Vec<usize> = Walk::new(vec![3, 2], vec![1, 3], 0).collect();
        assert_eq!(got, vec![0, 3, 1, 4, 2, 5]);
        assert_eq!(Walk::new(vec![], vec![], 7).collect::<Vec<_>>(), vec![7]);
        assert_eq!(Walk::new(vec![2, 0], vec![1, 1], 0).count(), 0);
    }
}
