//! Text tables whose columns fit their contents (reports, explanations).

/// A table: `head` and `rows` (the same number of cells each), each column as wide as its
/// widest cell (counted in characters, so `µs` is two), right-aligned where `right` says
/// (numbers), two spaces between columns, no trailing spaces.
pub fn table<S: AsRef<str>>(head: &[&str], rows: &[impl AsRef<[S]>], right: &[bool]) -> String {
    let cols = head.len();
    let mut width: Vec<usize> = head.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (c, cell) in r.as_ref().iter().enumerate().take(cols) {
            width[c] = width[c].max(cell.as_ref().chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (c, cell) in cells.iter().enumerate() {
            let pad = width[c].saturating_sub(cell.chars().count());
            if c > 0 {
                s.push_str("  ");
            }
            if right.get(c).copied().unwrap_or(false) {
                s.push_str(&" ".repeat(pad));
                s.push_str(cell);
            } else {
                s.push_str(cell);
                s.push_str(&" ".repeat(pad));
            }
        }
        let mut s = s.trim_end().to_string();
        s.push('\n');
        s
    };
    let mut t = line(head.to_vec());
    for r in rows {
        t.push_str(&line(r.as_ref().iter().map(|c| c.as_ref()).collect()));
    }
    t
}

#[cfg(test)]
mod tests {
    #[test]
    fn columns_fit_their_widest_cell() {
        let rows = vec![
            vec!["a_very_long_op_name_that_used_to_break_the_columns".to_string(), "1.0".into()],
            vec!["b".to_string(), "123.5".into()],
        ];
        let t = super::table(&["layer", "µs"], &rows, &[false, true]);
        let lines: Vec<&str> = t.lines().collect();
        // Every row ends its number in the same column.
        let ends: Vec<usize> = lines.iter().map(|l| l.chars().count()).collect();
        assert_eq!(ends, vec![ends[1]; 3], "{t}");
        assert!(lines[2].starts_with("b "), "{t}");
    }
}
