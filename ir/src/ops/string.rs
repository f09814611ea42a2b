//! String tensors: `StringConcat`, `StringSplit`, `StringNormalizer`, `RegexFullMatch`. They
//! run on the host (a device holds numbers), evaluated by the reference kernels.

use super::flow::flow_positional;
use super::shape::no_work_whole;
use super::util::{bcast_shapes, broadcast_index, broadcast_shapes};
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Types, Work};
use crate::array::{Array, Data, EvalError};
use crate::graph::op;
use crate::layout::IterSpace;
use crate::types::{DType, Dim, TensorType};

type Result<T> = std::result::Result<T, EvalError>;

fn strings<'a>(a: &'a Array, what: &str) -> Result<&'a [String]> {
    match &a.data {
        Data::Str(v) => Ok(v),
        _ => Err(EvalError::Invalid(format!("{what} needs string tensors, got {}", a.dtype))),
    }
}

fn string_array(shape: Vec<usize>, v: Vec<String>) -> Array {
    Array { dtype: DType::String, shape, data: Data::Str(v) }
}

impl OpRules for op::StringConcat {
    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        cx.broadcast_all();
        Some(())
    }

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(a), Some(b)) = (cx.dims(0), cx.dims(1)) else {
            return Ok(vec![Some(TensorType { dtype: DType::String, dims: None })]);
        };
        Ok(vec![Some(TensorType::new(DType::String, bcast_shapes(a, b)?))])
    }

    no_work_whole!();

    /// Element-wise concatenation, broadcast.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (a, b) = (cx.req(0)?, cx.req(1)?);
        let (x, y) = (strings(a, "StringConcat")?, strings(b, "StringConcat")?);
        let shape = broadcast_shapes(&a.shape, &b.shape)?;
        let (ia, ib) = (broadcast_index(&shape, &a.shape), broadcast_index(&shape, &b.shape));
        let v = ia.iter().zip(&ib).map(|(&i, &j)| format!("{}{}", x[i], y[j])).collect();
        Ok(vec![string_array(shape, v)])
    }
}

impl OpRules for op::StringSplit {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(1, 1, 2, 2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        // The number of pieces is known only from the data.
        cx.needs_values(&[0]);
        let d = cx.dims(0).cloned();
        let y = d.clone().map(|mut d| {
            d.push(Dim::Unknown);
            d
        });
        Ok(vec![Some(TensorType { dtype: DType::String, dims: y }), Some(TensorType { dtype: DType::Int64, dims: d })])
    }

    no_work_whole!();

    /// Each string split by the delimiter (by runs of whitespace, ends trimmed, when it is
    /// empty), at most `maxsplit` times; the pieces padded with empty strings to the longest.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let v = strings(x, "StringSplit")?;
        let delim = self.delimiter.as_deref().filter(|d| !d.is_empty());
        let max = self.maxsplit.filter(|&m| m >= 0).map(|m| m as usize);
        let pieces: Vec<Vec<String>> = v
            .iter()
            .map(|s| match delim {
                Some(d) => match max {
                    Some(m) => s.splitn(m + 1, d).map(str::to_string).collect(),
                    None => s.split(d).map(str::to_string).collect(),
                },
                None => {
                    let mut out: Vec<String> = Vec::new();
                    let mut rest = s.trim_start();
                    while !rest.is_empty() {
                        if max.is_some_and(|m| out.len() == m) {
                            out.push(rest.to_string());
                            break;
                        }
                        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
                        out.push(rest[..end].to_string());
                        rest = rest[end..].trim_start();
                    }
                    out
                }
            })
            .collect();
        let width = pieces.iter().map(Vec::len).max().unwrap_or(0);
        let counts: Vec<i64> = pieces.iter().map(|p| p.len() as i64).collect();
        let mut flat = Vec::with_capacity(pieces.len() * width);
        for mut p in pieces {
            p.resize(width, String::new());
            flat.extend(p);
        }
        let mut shape = x.shape.clone();
        shape.push(width);
        Ok(vec![string_array(shape, flat), Array::i64(x.shape.clone(), counts)])
    }
}

impl OpRules for op::StringNormalizer {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        // Strings that become empty are dropped: the length depends on the data.
        cx.needs_values(&[0]);
        Ok(vec![Some(TensorType {
            dtype: DType::String,
            dims: cx.dims(0).map(|d| {
                let mut d = d.clone();
                if let Some(last) = d.last_mut() {
                    *last = Dim::Unknown;
                }
                d
            }),
        })])
    }

    no_work_whole!();

    /// Stop words removed (word by word, case-sensitively or not), case changed; a vector (or
    /// a `[1, n]` matrix) then drops the strings left empty, keeping one empty string if none
    /// remains.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let v = strings(x, "StringNormalizer")?;
        if x.rank() > 2 || x.rank() == 0 {
            return Err(EvalError::Invalid("StringNormalizer needs a vector or a matrix".into()));
        }
        let action = self.case_change_action();
        let change = |s: &str| -> String {
            match action {
                "LOWER" => s.to_lowercase(),
                "UPPER" => s.to_uppercase(),
                _ => s.to_string(),
            }
        };
        let sensitive = self.is_case_sensitive() != 0;
        let raw: Vec<String> = self.stopwords.clone().unwrap_or_default();
        let stops: Vec<String> = if sensitive { raw.clone() } else { raw.iter().map(|w| change(w)).collect() };
        let drop_words = |s: &str, stops: &[String]| -> String {
            s.split(' ').filter(|w| !stops.iter().any(|t| t == w)).collect::<Vec<_>>().join(" ")
        };
        let out: Vec<String> = v
            .iter()
            .map(|s| {
                if sensitive && !stops.is_empty() {
                    change(&drop_words(s, &stops))
                } else if !stops.is_empty() {
                    drop_words(&change(s), &stops)
                } else {
                    change(s)
                }
            })
            .collect();
        let one_row = x.rank() == 1 || x.shape[0] == 1;
        if !one_row {
            return Ok(vec![string_array(x.shape.clone(), out)]);
        }
        let mut kept: Vec<String> = out.into_iter().filter(|s| !s.is_empty()).collect();
        if kept.is_empty() {
            kept.push(String::new());
        }
        let shape = if x.rank() == 1 { vec![kept.len()] } else { vec![1, kept.len()] };
        Ok(vec![string_array(shape, kept)])
    }
}

impl OpRules for op::RegexFullMatch {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        Ok(vec![cx.with(Some(DType::Bool), cx.dims(0).cloned())])
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(cx.out_numel(0))
    }

    /// Whether each whole string matches the pattern (RE2 syntax, which the `regex` crate
    /// follows).
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let v = strings(x, "RegexFullMatch")?;
        let pat = self.pattern.as_deref().unwrap_or("");
        let re = regex::Regex::new(&format!("^(?:{pat})$"))
            .map_err(|e| EvalError::Invalid(format!("RegexFullMatch pattern `{pat}`: {e}")))?;
        Ok(vec![Array::bool(x.shape.clone(), v.iter().map(|s| re.is_match(s)).collect())])
    }
}
